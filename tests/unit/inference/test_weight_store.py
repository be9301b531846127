"""The cache the swarm fills (weights/store.py) with the bytes of a real tiny checkpoint: a group
written chunk by chunk in any order becomes a safetensors file equal to the original tensors; a
staging file resumes or starts over; a manifest is kept only when it is the model's; a directory
holding just the manifest and the config is a checkpoint that knows the whole model."""

import hashlib
import random
from pathlib import Path

import cbor2
import pytest
import torch
from safetensors import safe_open

from shardnet.errors import CheckpointError
from shardnet.inference.model.checkpoint import Checkpoint, model_id_of
from shardnet.inference.weights.store import INDEX, PARTIAL, WeightStore, group_of
from shardnet.protocols import weights as wp

TINY = Path(__file__).resolve().parents[3] / "shardnet" / "models" / "tiny-llama"


@pytest.fixture(scope="module")
def tiny():
    ckpt = Checkpoint(TINY)
    ckpt.manifest()
    return ckpt


def raw_bytes(ckpt: Checkpoint, name: str) -> bytes:
    e = ckpt.entries[name]
    with open(e.file, "rb") as fh:
        fh.seek(e.start)
        return fh.read(e.size)


def group_tensors(ckpt: Checkpoint, group: str) -> dict[str, list]:
    return {n: v for n, v in ckpt.manifest()["tensors"].items() if group_of(n) == group}


def all_chunks(ckpt: Checkpoint, tensors: dict[str, list]) -> list[tuple[str, int, bytes]]:
    out = []
    for name, (_dtype, _shape, size, _root) in tensors.items():
        data = raw_bytes(ckpt, name)
        assert len(data) == size
        for i in range(wp.chunk_count(size)):
            a, b = wp.chunk_span(size, i)
            out.append((name, i, data[a:b]))
    return out


def store_with_manifest(tmp_path: Path, ckpt: Checkpoint) -> WeightStore:
    store = WeightStore(ckpt.model_id, root=tmp_path)
    store.put_manifest(ckpt.manifest_bytes())
    return store


def assert_same_tensors(path: Path, ckpt: Checkpoint, names) -> None:
    original = ckpt.load(list(names))
    with safe_open(str(path), framework="pt") as st:
        assert sorted(st.keys()) == sorted(names)
        for n in names:
            assert torch.equal(st.get_tensor(n), original[n]), n


def test_group_names():
    assert group_of("model.layers.12.mlp.up_proj.weight") == "layer-00012"
    assert [group_of(n) for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                                  "rotary.inv_freq")] == ["embed", "norm", "lm_head", "other"]


# small chunks make every tensor of the tiny model several chunks, as real tensors are
@pytest.mark.parametrize("chunk_size", [wp.CHUNK_SIZE, 16384], ids=["1MiB", "16KiB"])
def test_a_group_written_in_any_order_loads_as_the_original(tmp_path, tiny, monkeypatch, chunk_size):
    monkeypatch.setattr(wp, "CHUNK_SIZE", chunk_size)
    store = store_with_manifest(tmp_path, tiny)
    tensors = group_tensors(tiny, "layer-00001")
    assert len(tensors) == 9
    writer = store.group_writer("layer-00001", tensors)
    chunks = all_chunks(tiny, tensors)
    assert len(chunks) == (9 if chunk_size == 1 << 20 else 3 * 18 + 2 * 7 + 2 * 4 + 2)
    random.Random(chunk_size).shuffle(chunks)
    for name, i, data in chunks:
        assert not writer.has(name, i) and not writer.complete()
        writer.write(name, i, data)
        assert writer.has(name, i) and writer.read(name, i) == data
    assert writer.complete()
    store.finish_group(writer)
    final = store.path / "model-layer-00001.safetensors"
    assert final.is_file() and not (store.path / PARTIAL / "model-layer-00001.chunks").exists()
    assert not (store.path / PARTIAL / "model-layer-00001.safetensors").exists()
    assert_same_tensors(final, tiny, tensors)
    assert store.weight_map() == {n: final.name for n in tensors}
    assert store.missing(["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]) == ["model.norm.weight"]


def test_a_reopened_writer_resumes_with_its_chunks(tmp_path, tiny):
    store = store_with_manifest(tmp_path, tiny)
    tensors = group_tensors(tiny, "layer-00000") | group_tensors(tiny, "norm")
    chunks = all_chunks(tiny, tensors)
    random.Random(7).shuffle(chunks)
    half = len(chunks) // 2
    writer = store.group_writer("mixed", tensors)
    for name, i, data in chunks[:half]:
        writer.write(name, i, data)
    writer.close()  # the fetch dies here
    writer = store.group_writer("mixed", tensors)
    assert [writer.has(n, i) for n, i, _ in chunks] == [True] * half + [False] * (len(chunks) - half)
    assert all(writer.read(n, i) == d for n, i, d in chunks[:half])
    for name, i, data in chunks[half:]:
        writer.write(name, i, data)
    store.finish_group(writer)
    assert_same_tensors(store.path / "model-mixed.safetensors", tiny, tensors)


def test_a_chunk_forgotten_is_fetched_again(tmp_path, tiny):
    store = store_with_manifest(tmp_path, tiny)
    tensors = group_tensors(tiny, "norm")
    (name, i, data), = all_chunks(tiny, tensors)
    writer = store.group_writer("norm", tensors)
    writer.write(name, i, data)
    writer.forget(name, i)
    writer.close()
    writer = store.group_writer("norm", tensors)
    assert not writer.has(name, i) and not writer.complete()
    writer.close()


def test_a_staging_file_of_another_layout_is_started_over(tmp_path, tiny):
    store = store_with_manifest(tmp_path, tiny)
    tensors = group_tensors(tiny, "layer-00002")
    writer = store.group_writer("layer-00002", tensors)
    for name, i, data in all_chunks(tiny, tensors):
        writer.write(name, i, data)
    assert writer.complete()
    writer.close()
    # same names and sizes, another dtype of the same length: the same file size and chunk count,
    # so only the header tells the layouts apart
    relabelled = {n: ["I16", *v[1:]] for n, v in tensors.items()}
    writer = store.group_writer("layer-00002", relabelled)
    assert not any(writer.bitmap) and not writer.complete()
    writer.close()
    # fewer tensors: a smaller file and bitmap
    fewer = dict(list(tensors.items())[:3])
    writer = store.group_writer("layer-00002", fewer)
    assert len(writer.bitmap) == 3 and not any(writer.bitmap)
    writer.close()
    # a bitmap lost (or torn) is no proof of anything written: start over
    writer = store.group_writer("layer-00002", tensors)
    for name, i, data in all_chunks(tiny, tensors):
        writer.write(name, i, data)
    writer.close()
    writer.bitmap_path.write_bytes(b"\1")
    writer = store.group_writer("layer-00002", tensors)
    assert not any(writer.bitmap)
    writer.close()


def test_put_manifest_keeps_only_the_models_manifest(tmp_path, tiny):
    raw = tiny.manifest_bytes()
    store = WeightStore(tiny.model_id, root=tmp_path)
    with pytest.raises(CheckpointError, match=rf"^the manifest received does not hash to model {tiny.model_id[:16]}…$"):
        store.put_manifest(raw + b"\0")
    assert not store.has_manifest()
    # the same map in another key order: a valid manifest, but not as the ID's hash is taken
    manifest = cbor2.loads(raw)
    shuffled = dict(reversed(list(manifest.items())))
    other = cbor2.dumps(shuffled)
    assert other != raw and cbor2.loads(other) == manifest
    store2 = WeightStore(hashlib.sha256(other).hexdigest(), root=tmp_path)
    with pytest.raises(CheckpointError, match="is not in canonical form$"):
        store2.put_manifest(other)
    assert not store2.has_manifest()
    # not a manifest at all, though it hashes to its ID
    junk = cbor2.dumps({"version": 1}, canonical=True)
    with pytest.raises(CheckpointError, match="manifest version 1 is not supported"):
        WeightStore(hashlib.sha256(junk).hexdigest(), root=tmp_path).put_manifest(junk)
    assert store.put_manifest(raw) == manifest and store.manifest() == manifest
    assert model_id_of(store.manifest()) == tiny.model_id


def test_a_directory_with_the_manifest_and_config_knows_the_whole_model(tmp_path, tiny):
    store = store_with_manifest(tmp_path, tiny)
    config = (TINY / "config.json").read_bytes()
    store.put_file("config.json", config, wp.chunk_hash(config))
    store.add_names(["tiny-llama"])
    fetched = Checkpoint(store.path)
    assert fetched.fetched and fetched.entries == {}
    assert set(fetched.catalog) == set(tiny.catalog) == set(tiny.manifest()["tensors"])
    assert all(fetched.catalog[n] == tiny.catalog[n] for n in tiny.catalog)
    assert fetched.num_layers == tiny.num_layers and fetched.head_parts() == tiny.head_parts()
    assert fetched.model_id == tiny.model_id and fetched.manifest_bytes() == tiny.manifest_bytes()
    assert fetched.names == ["tiny-llama"] and fetched.held_prefixes() == ["file:"]
    assert fetched.blob_hashes("file:config.json") == wp.chunk_hash(config)
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(CheckpointError, match=rf"^tensor {name} has not been fetched to "):
        fetched.load([name])
    with pytest.raises(CheckpointError, match="tensor model.layers.99.x is not in "):
        fetched.load(["model.layers.99.x"])
    # a group fetched later is found after refresh(), and loads as the original
    tensors = group_tensors(tiny, "layer-00000")
    writer = store.group_writer("layer-00000", tensors)
    for n, i, data in all_chunks(tiny, tensors):
        writer.write(n, i, data)
    store.finish_group(writer)
    fetched.refresh()
    assert fetched.holds(list(tensors)) and not fetched.holds(["model.norm.weight"])
    assert fetched.held_prefixes() == ["file:", "tensor:model.layers.0."]
    got, want = fetched.load([name]), tiny.load([name])
    assert torch.equal(got[name], want[name])
    assert (store.path / INDEX).is_file()
