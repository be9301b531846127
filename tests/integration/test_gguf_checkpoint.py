"""GGUF checkpoints (llama.cpp's format) through a chain of real peers, kept in their stored
quantization.

A tiny random float32 llama is written as GGUF (``shardnet.testing.gguf``: Q8_0, and Q4_K with
llama.cpp's q/k row permutation, F32 norms, F16 embedding and head). The chain serving the
.gguf must compute what transformers computes on its own GGUF load of the same file
(``from_pretrained(..., gguf_file=...)``, which dequantizes every tensor with gguf-py), in float32.
"""

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from shardnet.errors import CheckpointError
from shardnet.inference.client.client import Client
from shardnet.inference.model.block import Block
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.inference.model.stored import StoredWeight, module_stored_nbytes
from shardnet.inference.server.placement import layer_bytes
from shardnet.testing.gguf import GGUF_FILE, convert_to_gguf, transformers_gguf_model
from shardnet.testing.helpers import (
    EXACT_NEW_TOKENS,
    EXACT_PROMPT,
    chain_last_logits,
    chain_token_ids,
    local_chain,
    one_line,
    transformers_generate,
)

QTYPES = ("Q8_0", "Q4_K")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """qtype -> (the float32 original, its GGUF directory). hidden 256: Q4_K's super-blocks fill rows."""
    root = tmp_path_factory.mktemp("gguf")
    plain = init_random(root / "llama-f32", "llama", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512,
                        vocab=512, seed=11)
    return {q: (plain, convert_to_gguf(plain, root / f"llama-{q}", q)) for q in QTYPES}


def transformers_gguf_reference(directory, prompt, new):
    model = transformers_gguf_model(directory)
    out = transformers_generate(model, torch.tensor([prompt]), new)
    with torch.inference_mode():
        logits = model(out[:, :-1]).logits[0, -1].float()
    return out[0].tolist()[len(prompt):], logits, model.state_dict()


@pytest.mark.parametrize("qtype", QTYPES)
async def test_gguf_chain_matches_transformers_own_gguf_load(loopback_config, checkpoints, qtype):
    _, gguf_dir = checkpoints[qtype]
    want_ids, want_logits, theirs = transformers_gguf_reference(gguf_dir, EXACT_PROMPT, EXACT_NEW_TOKENS)
    ckpt = Checkpoint(gguf_dir)
    assert ckpt.entries["model.layers.1.self_attn.q_proj.weight"].dtype == f"GGUF_{qtype}"
    # every weight a block holds is what transformers' load holds (q/k rows un-permuted, bit for bit)
    block = Block(ckpt, 0, 4, dtype=torch.float32)
    for name, t in block.layers.state_dict().items():
        t = t.dequantize() if isinstance(t, StoredWeight) else t
        assert torch.equal(t, theirs[f"model.layers.{name}"]), name
    async with local_chain(loopback_config, gguf_dir, [(0, 2), (2, 4)]) as node:
        model = LocalModel(gguf_dir)
        assert model.dtype == torch.float32
        client = Client(node, model)
        got = await chain_token_ids(client, EXACT_PROMPT, EXACT_NEW_TOKENS)
        assert [(c.start, c.end, c.dtype) for c in client.last_stats.chain] == [(0, 2, "float32"), (2, 4, "float32")]
        logits = await chain_last_logits(client, EXACT_PROMPT + got)
    assert got == want_ids
    # same weights (checked above), float32; the chain's prefill-then-decode sums in another order
    # than one full forward: measured 2.1e-5 (Q8_0) and 1.8e-5 (Q4_K)
    assert torch.allclose(logits, want_logits, atol=1e-4, rtol=0), (logits - want_logits).abs().max()


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_loaded_gguf_block_holds_the_stored_bytes(checkpoints, qtype):
    plain, gguf_dir = checkpoints[qtype]
    ckpt = Checkpoint(gguf_dir)
    reader = GGUFReader(gguf_dir / GGUF_FILE)
    in_file = {t.name: int(t.n_bytes) for t in reader.tensors}
    for i in range(4):
        stored = sum(n for name, n in in_file.items() if name.startswith(f"blk.{i}."))
        assert sum(ckpt.entries[n].size for n in ckpt.layer_tensors(i)) == stored
        # F32 norms count at the compute dtype, which is their stored size in float32
        assert layer_bytes(ckpt, i, "float32") == stored
        block = Block(ckpt, i, i + 1, dtype=torch.float32)
        assert abs(module_stored_nbytes(block.layers) - stored) < 0.02 * stored
        assert isinstance(block.layers[0].mlp.down_proj.weight, StoredWeight)
    f32 = sum(Checkpoint(plain).entries[n].size for n in Checkpoint(plain).layer_tensors(0))
    ratio = layer_bytes(ckpt, 0, "float32") / f32
    # Q8_0: 34 bytes per 32 weights (8.5 bits); Q4_K: 144 per 256 (4.5 bits), of float32's 32
    assert abs(ratio - {"Q8_0": 8.5 / 32, "Q4_K": 4.5 / 32}[qtype]) < 0.01, ratio


def test_gguf_checkpoint_identity(checkpoints, tmp_path):
    """Model IDs cover the header (config) and the stored tensors; the .gguf file itself names
    the checkpoint too."""
    ids = {Checkpoint(d).model_id for _, d in checkpoints.values()}
    assert len(ids) == 2
    _, q8 = checkpoints["Q8_0"]
    ckpt = Checkpoint(q8 / GGUF_FILE)
    assert ckpt.path == q8 and ckpt.model_id in ids
    manifest = ckpt.manifest()
    name, size, _ = manifest["gguf"]
    assert name == GGUF_FILE and size == GGUFReader(q8 / GGUF_FILE).data_offset
    assert "tokenizer.json" in manifest["files"] and "config.json" not in manifest["files"]
    assert ckpt.blob_location(f"gguf:{GGUF_FILE}") == (q8 / GGUF_FILE, 0, size)


def test_a_gguf_of_another_architecture_is_refused_in_one_line(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'qwen2' is not supported \(supported: llama\)") as e:
        Checkpoint(tmp_path)
    one_line(e.value)


def test_two_gguf_files_in_one_directory_are_refused(checkpoints, tmp_path):
    _, q8 = checkpoints["Q8_0"]
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / n).write_bytes((q8 / GGUF_FILE).read_bytes())
    with pytest.raises(CheckpointError, match="holds 2 .gguf files") as e:
        Checkpoint(tmp_path)
    one_line(e.value)
    assert Checkpoint(tmp_path / "a.gguf").gguf_file == tmp_path / "a.gguf"


async def test_a_peer_fetches_only_its_span_of_a_gguf_over_the_swarm_and_serves_it(loopback_config, checkpoints,
                                                                                  tmp_path):
    """The header (the config) and the span's tensors travel as blobs checked against the
    manifest; the fetched directory is a GGUF checkpoint whose block holds the same stored bytes,
    and a chain of a peer serving the .gguf and one serving what it fetched computes what
    transformers' GGUF load computes."""
    from contextlib import AsyncExitStack

    import trio

    from shardnet.inference.model.checkpoint import FETCHED_GGUF_HEADER
    from shardnet.inference.server.compute_peer import serve_block
    from shardnet.inference.weights.cards import list_models
    from shardnet.inference.weights.swarm_model import fetch_tensors, open_from_swarm, span_tensor_names
    from shardnet.transport import open_node

    _, q4 = checkpoints["Q4_K"]
    complete = Checkpoint(q4)
    want_ids, _, _ = transformers_gguf_reference(q4, EXACT_PROMPT, EXACT_NEW_TOKENS)
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config()))
        cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
        serving = await stack.enter_async_context(open_node(cfg))
        await stack.enter_async_context(serve_block(serving, str(q4), 0, 2))  # it serves the weights too
        fetching = await stack.enter_async_context(open_node(cfg))
        await fetching.wait_bootstrapped()
        with trio.fail_after(30):
            while not await list_models(fetching, timeout=5):
                await trio.sleep(0.2)
        path, card = await open_from_swarm(fetching, q4.name, cache_root=tmp_path)
        assert card.model_id == complete.model_id
        ckpt = Checkpoint(path)
        assert ckpt.fetched and ckpt.entries == {} and ckpt.raw_config == complete.raw_config
        header = complete.manifest()["gguf"][1]
        assert (path / FETCHED_GGUF_HEADER).read_bytes() == (q4 / GGUF_FILE).read_bytes()[:header]
        names = span_tensor_names(ckpt, 2, 4)
        report = await fetch_tensors(fetching, ckpt, names)
        assert report.done == sum(complete.entries[n].size for n in names) < 0.7 * (q4 / GGUF_FILE).stat().st_size
        await stack.enter_async_context(serve_block(fetching, str(path), 2, 4))
        client_node = await stack.enter_async_context(open_node(cfg))
        await client_node.wait_bootstrapped()
        client = Client(client_node, LocalModel(q4))
        got = await chain_token_ids(client, EXACT_PROMPT, EXACT_NEW_TOKENS)
        assert [(c.start, c.end) for c in client.last_stats.chain] == [(0, 2), (2, 4)]
    assert got == want_ids
    assert sorted(ckpt.entries) == sorted(names)
    theirs, ours = Block(complete, 2, 4, dtype=torch.float32), Block(ckpt, 2, 4, dtype=torch.float32)
    assert module_stored_nbytes(ours.layers) == module_stored_nbytes(theirs.layers)
    want = theirs.layers.state_dict()
    for name, t in ours.layers.state_dict().items():
        assert isinstance(t, StoredWeight) == isinstance(want[name], StoredWeight), name
        if isinstance(t, StoredWeight):
            assert torch.equal(t.parts["blocks"], want[name].parts["blocks"]), name
        else:
            assert torch.equal(t, want[name]), name
    # and it serves on what it holds, the header included
    assert {"file:", "gguf:", "tensor:model.layers.2.", "tensor:model.layers.3."} <= set(ckpt.held_prefixes())
    assert ckpt.blob_location(f"gguf:{GGUF_FILE}") == (path / FETCHED_GGUF_HEADER, 0, header)
    assert ckpt.blob_hashes(f"gguf:{GGUF_FILE}") == complete.blob_hashes(f"gguf:{GGUF_FILE}")
