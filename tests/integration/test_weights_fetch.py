"""Weights over the swarm, in one process with real hosts: model cards, name resolution, a span
fetched from several peers, chunks checked on arrival (a peer sending bad bytes is dropped and the
fetch completes from others), resuming from verified chunks, the limits of serving, and a name
kept bound against fake peers claiming it."""

import dataclasses
import json
import struct
from contextlib import AsyncExitStack

import pytest
import trio
from safetensors import safe_open

from shardnet.errors import ShardnetError
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.random_model import init_random
from shardnet.inference.weights import fetcher as fetcher_mod
from shardnet.inference.weights.cards import ModelNotFound, list_models, resolve_model
from shardnet.inference.weights.names import NameBindings, NameConflict
from shardnet.inference.weights.server import WeightServer
from shardnet.inference.weights.store import WeightStore
from shardnet.inference.weights.swarm_model import fetch_tensors, open_from_swarm, span_tensor_names
from shardnet.protocols import weights as wp
from shardnet.transport import open_node
from shardnet.transport.limits import Limits


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # layers of ~1.3 MB: several 1 MiB chunks per big tensor, so chunks spread over sources
    return init_random(tmp_path_factory.mktemp("w") / "wmodel", "llama", layers=4, hidden=256, heads=4, kv_heads=2,
                       intermediate=1024, vocab=1024, seed=5)


class CorruptingServer(WeightServer):
    """Serves chunks with one byte flipped (a disk gone bad, or a peer lying)."""

    async def _answer(self, request):
        reply = await super()._answer(request)
        if request.op == "chunk" and reply.ok and reply.data:
            data = bytearray(reply.data)
            data[len(data) // 2] ^= 0xFF
            reply = wp.Reply(True, data=bytes(data))
        return reply


class FailingServer(WeightServer):
    """Answers every chunk request with an error (a broken disk, a bug)."""

    async def _answer(self, request):
        if request.op == "chunk":
            return wp.Reply.failure("internal", "disk on fire")
        return await super()._answer(request)


class StallingServer(WeightServer):
    """Takes every chunk request and never answers it."""

    async def _answer(self, request):
        if request.op == "chunk":
            await trio.sleep_forever()
        return await super()._answer(request)


async def _swarm(stack, loopback_config, model, servers, **server_limits):
    """A bootstrap node, one node per server class serving the whole checkpoint, and a fetcher."""
    boot = await stack.enter_async_context(open_node(loopback_config()))
    cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
    ckpt = Checkpoint(model)
    held = []
    for cls in servers:
        n = await stack.enter_async_context(open_node(loopback_config(bootstrap=cfg.bootstrap,
                                                                      limits=Limits(**server_limits))))
        await n.wait_bootstrapped()
        server = await n.add_behaviour(cls(n))
        server.add(ckpt)
        held.append((n, server))
    fetching = await stack.enter_async_context(open_node(cfg))
    await fetching.wait_bootstrapped()
    with trio.fail_after(30):  # every server's card and provider records out (a server waits a moment first)
        while len({p for m in await list_models(fetching, timeout=5) for p in m.publishers}) < len(servers):
            await trio.sleep(0.2)
    return fetching, held


def _same_tensors(fetched_dir, original, names):
    a, b = Checkpoint(fetched_dir), Checkpoint(original)
    for n in names:
        ea, eb = a.entries[n], b.entries[n]
        with open(ea.file, "rb") as fa, open(eb.file, "rb") as fb:
            fa.seek(ea.start)
            fb.seek(eb.start)
            assert fa.read(ea.size) == fb.read(eb.size), n


async def test_a_span_is_fetched_from_several_peers_and_verified(loopback_config, model, tmp_path):
    async with AsyncExitStack() as stack:
        fetching, held = await _swarm(stack, loopback_config, model, [WeightServer, WeightServer, WeightServer])
        card = await resolve_model(fetching, "wmodel")
        assert card.model_id == Checkpoint(model).model_id and card.num_layers == 4 and card.family == "llama"
        listed = await list_models(fetching)
        # three peers publish its card; none claims layers (they serve bytes, not compute)
        assert [m.card.model_id for m in listed] == [card.model_id] and len(listed[0].publishers) == 3
        assert listed[0].peers == 0 and listed[0].covered == []

        path, _ = await open_from_swarm(fetching, "wmodel", cache_root=tmp_path)
        assert path == tmp_path / card.model_id
        ckpt = Checkpoint(path)
        assert ckpt.fetched and ckpt.model_id == card.model_id and ckpt.entries == {}
        assert (path / "config.json").read_bytes() == (model / "config.json").read_bytes()
        assert (path / "tokenizer.json").is_file()

        names = span_tensor_names(ckpt, 1, 3)
        report = await fetch_tensors(fetching, ckpt, names)
        assert not report.bad and report.done == sum(ckpt.catalog[n].size for n in names)
        assert len(report.per_source) >= 2, report.per_source  # the chunks came from several peers
        assert sorted(ckpt.entries) == sorted(names)
        _same_tensors(path, model, names)
        # a layout others can read: one safetensors file per layer, named in the index
        weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(weight_map.values()) == {"model-layer-00001.safetensors", "model-layer-00002.safetensors"}
        with safe_open(str(path / "model-layer-00001.safetensors"), "pt") as f:
            assert len(list(f.keys())) == len(ckpt.layer_tensors(1))
        assert not list((path / ".partial").iterdir())
        # nothing more to fetch the second time
        assert await fetch_tensors(fetching, ckpt, names) is None
        # and what this node now holds it serves on, under the same ID
        assert set(ckpt.held_prefixes()) == {"file:", "tensor:model.layers.1.", "tensor:model.layers.2."}


async def test_a_peer_sending_bad_chunks_is_dropped_and_the_fetch_completes(loopback_config, model, tmp_path):
    async with AsyncExitStack() as stack:
        fetching, held = await _swarm(stack, loopback_config, model, [CorruptingServer, WeightServer])
        path, _ = await open_from_swarm(fetching, "wmodel", cache_root=tmp_path)
        ckpt = Checkpoint(path)
        names = span_tensor_names(ckpt, 0, 4)
        report = await fetch_tensors(fetching, ckpt, names)
        liar = str(held[0][0].peer_id)
        assert report.bad == [liar]
        assert liar not in report.per_source  # none of its bytes were kept
        _same_tensors(path, model, names)


async def test_only_liars_left_is_a_one_line_failure_and_nothing_unverified_is_loadable(loopback_config, model,
                                                                                        tmp_path, monkeypatch):
    monkeypatch.setattr(fetcher_mod, "ROUNDS", 1)
    async with AsyncExitStack() as stack:
        fetching, held = await _swarm(stack, loopback_config, model, [CorruptingServer])
        # files come from the liar too: the manifest (checked against the ID) is fine, the files are not
        with pytest.raises(fetcher_mod.FetchError, match=r"could not be fetched.*bad bytes from"):
            await open_from_swarm(fetching, "wmodel", cache_root=tmp_path)
        store = WeightStore(Checkpoint(model).model_id, tmp_path)
        assert not (store.path / "config.json").exists()  # nothing written that was not verified


async def test_a_fetch_resumes_from_the_chunks_it_verified(loopback_config, model, tmp_path):
    async with AsyncExitStack() as stack:
        # served at 8 MB/s, so that the fetch is still going when it is killed
        fetching, held = await _swarm(stack, loopback_config, model, [WeightServer], weights_mb_per_s=8.0)
        path, _ = await open_from_swarm(fetching, "wmodel", cache_root=tmp_path)
        ckpt = Checkpoint(path)
        names = span_tensor_names(ckpt, 0, 4)
        total = sum(ckpt.catalog[n].size for n in names)
        halfway = trio.Event()

        def progress(p):
            if p.done > total // 2:
                halfway.set()

        with trio.CancelScope() as scope:  # the fetch is killed halfway
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: fetch_tensors(fetching, ckpt, names, progress=progress))
                await halfway.wait()
                scope.cancel()
        bitmaps = sorted((path / ".partial").glob("*.chunks"))
        assert bitmaps, "the interrupted fetch left its verified chunks to resume from"
        # a torn write: a chunk marked in whose bytes on disk are not what was verified is fetched again
        torn = next(b for b in bitmaps if b.read_bytes()[:1] == b"\1")
        data_file = torn.with_suffix(".safetensors")
        with open(data_file, "r+b") as f:
            (header,) = struct.unpack("<Q", f.read(8))
            f.seek(8 + header)
            f.write(b"\xff" * 64)
        report = await fetch_tensors(fetching, ckpt, names)
        # the groups finished before the kill are not fetched again; in the rest, the verified chunks
        # are kept (all but the torn one)
        assert report.reused > 0 and report.done + report.reused == report.total
        assert report.done < total - report.reused
        _same_tensors(path, model, names)


async def test_unknown_model_names_what_the_swarm_serves(loopback_config, model):
    async with AsyncExitStack() as stack:
        fetching, _ = await _swarm(stack, loopback_config, model, [WeightServer])
        with pytest.raises(ModelNotFound, match=r"serves no model 'nope'.*it serves: wmodel"):
            await resolve_model(fetching, "nope", timeout=5)


async def test_weight_streams_per_peer_are_limited(loopback_config, model):
    async with AsyncExitStack() as stack:
        fetching, held = await _swarm(stack, loopback_config, model, [WeightServer])
        node, server = held[0]
        limit = node.config.limits.weights_streams_per_peer
        model_id = Checkpoint(model).model_id
        streams = [await fetching.new_stream(node.peer_id, wp.PROTOCOL_ID) for _ in range(limit + 1)]
        replies = []
        for s in streams:
            conn = wp.WeightsClient()
            await s.write(conn.send(wp.Request("have", model_id)))
            data = await s.read_some(65536)
            replies += [r for _, r in conn.receive_data(data)]
        assert [r.ok for r in replies] == [True] * limit + [False]
        assert replies[-1].code == "busy"
        for s in streams:
            await s.close()


async def test_a_peer_that_moves_fetches_the_layers_it_lacks(loopback_config, model, tmp_path):
    from shardnet.inference.server.compute_peer import ComputePeer

    async with AsyncExitStack() as stack:
        fetching, _ = await _swarm(stack, loopback_config, model, [WeightServer])
        path, _ = await open_from_swarm(fetching, "wmodel", cache_root=tmp_path)
        seen = []
        peer = ComputePeer(fetching, path, throughput=1.0, fetch_progress=seen.append)
        await peer.load(0, 2)
        assert sorted({n.split(".")[2] for n in peer.ckpt.entries if n.startswith("model.layers.")}) == ["0", "1"]
        await peer.load(2, 4)  # a move: layers 2-3 and the head's last parts are fetched first
        assert peer.span == (2, 4) and peer.ckpt.holds(span_tensor_names(peer.ckpt, 0, 4))
        assert seen and seen[-1].done + seen[-1].reused == seen[-1].total


@pytest.mark.parametrize("broken", [FailingServer, StallingServer])
async def test_a_failing_or_stalling_source_is_dropped_and_others_finish(loopback_config, model, tmp_path,
                                                                         monkeypatch, broken):
    monkeypatch.setattr(fetcher_mod, "STREAM_TIMEOUT", 3.0)
    async with AsyncExitStack() as stack:
        fetching, held = await _swarm(stack, loopback_config, model, [broken, WeightServer])
        with trio.fail_after(60):
            path, _ = await open_from_swarm(fetching, "wmodel", cache_root=tmp_path)
            ckpt = Checkpoint(path)
            names = span_tensor_names(ckpt, 0, 4)
            report = await fetch_tensors(fetching, ckpt, names)
        assert str(held[0][0].peer_id) in report.failed and not report.bad
        assert list(report.per_source) == [str(held[1][0].peer_id)]
        _same_tensors(path, model, names)


async def test_fake_peers_claiming_a_bound_name_do_not_take_it(loopback_config, model, tmp_path):
    """Three peers serve another model under the name "wmodel" after this node bound the name: it
    keeps meaning the model first seen; a node that never bound it is refused, listing both; a pin
    chooses; the swarm's listing shows the conflict."""
    fake = Checkpoint(init_random(tmp_path / "fake", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=300))
    async with AsyncExitStack() as stack:
        fetching, held = await _swarm(stack, loopback_config, model, [WeightServer])
        bound = NameBindings(tmp_path / "bound.json")
        genuine = (await resolve_model(fetching, "wmodel", bindings=bound)).model_id
        assert genuine == Checkpoint(model).model_id and bound.get("wmodel").model_id == genuine
        assert bound.get("wmodel").publishers == (str(held[0][0].peer_id),)

        bootstrap = [str(a) for a in fetching.config.bootstrap]
        for _ in range(3):
            n = await stack.enter_async_context(open_node(loopback_config(bootstrap=bootstrap)))
            await n.wait_bootstrapped()
            (await n.add_behaviour(WeightServer(n))).add(fake, ["wmodel"])
        with trio.fail_after(30):
            while not any(m.card.model_id == fake.model_id for m in await list_models(fetching, timeout=5)):
                await trio.sleep(0.2)
        with trio.fail_after(60):  # (every fake peer's card out)
            while len(next(m for m in await list_models(fetching, timeout=5)
                           if m.card.model_id == fake.model_id).publishers) < 3:
                await trio.sleep(0.2)

        assert (await resolve_model(fetching, "wmodel", bindings=bound)).model_id == genuine
        fresh = NameBindings(tmp_path / "fresh.json")
        with pytest.raises(NameConflict, match=rf"^model name 'wmodel' is claimed by 2 models: {fake.model_id[:12]} "
                                               rf"\(3 publishers: .*{genuine[:12]} \(publisher .*none is bound"):
            await resolve_model(fetching, "wmodel", bindings=fresh, timeout=5)
        assert fresh.get("wmodel") is None
        pinned = await resolve_model(fetching, f"wmodel@{fake.model_id[:8]}", bindings=fresh, timeout=5)
        assert pinned.model_id == fake.model_id and fresh.get("wmodel").model_id == fake.model_id
        listed = {m.card.model_id: m for m in await list_models(fetching)}
        assert listed[genuine].conflicts == {"wmodel": [fake.model_id]}
        assert listed[fake.model_id].conflicts == {"wmodel": [genuine]}


async def test_a_stored_format_travels_as_stored_and_loads_as_stored(loopback_config, model, tmp_path):
    """An FP8 checkpoint's span over the swarm: the FP8 bytes and their scales, unchanged (the
    manifest hashes the stored tensors), and a block loaded from them keeps them FP8."""
    import torch

    from shardnet.inference.model.block import Block
    from shardnet.inference.model.stored import StoredWeight, module_stored_nbytes
    from shardnet.inference.server.placement import layer_bytes
    from shardnet.testing.fp8 import quantize_checkpoint_fp8

    fp8 = quantize_checkpoint_fp8(model, tmp_path / "wmodel-fp8", block=(32, 32))
    async with AsyncExitStack() as stack:
        fetching, _ = await _swarm(stack, loopback_config, fp8, [WeightServer])
        original = Checkpoint(fp8)
        path, _ = await open_from_swarm(fetching, original.model_id, cache_root=tmp_path / "cache")
        ckpt = Checkpoint(path)
        names = span_tensor_names(ckpt, 1, 2)
        assert any(n.endswith("_scale_inv") for n in names)
        report = await fetch_tensors(fetching, ckpt, names)
        assert report.done == sum(original.catalog[n].size for n in names)
        _same_tensors(path, fp8, names)
    block = Block(Checkpoint(path), 1, 2, dtype=torch.bfloat16)
    assert any(isinstance(p, StoredWeight) for p in block.layers.parameters())
    assert abs(module_stored_nbytes(block.layers) - layer_bytes(Checkpoint(path), 1, "bfloat16")) < 0.02 * \
        layer_bytes(Checkpoint(path), 1, "bfloat16")


async def test_a_card_names_a_draft_that_clients_fetch_whole(loopback_config, model, tmp_path):
    """A peer serving a model and its draft (``join --draft``) names the draft in the model's card;
    ``fetch_draft`` finds it from the model's ID and fetches all of it, verified; a model whose card
    names none has no draft."""
    from shardnet.inference.weights.cards import ModelCard, card_of, draft_named_for
    from shardnet.inference.weights.swarm_model import fetch_draft

    draft_dir = init_random(tmp_path / "src" / "wdraft", "llama", layers=1, hidden=64, heads=2, kv_heads=1,
                            intermediate=128, vocab=1024, seed=6)
    target, draft = Checkpoint(model), Checkpoint(draft_dir)
    card = card_of(target, draft=draft.model_id)
    assert ModelCard.decode(card.encode()) == card and ModelCard.decode(card_of(target).encode()).draft is None
    with pytest.raises(ShardnetError, match="malformed"):
        ModelCard.decode(dataclasses.replace(card, draft="not an id").encode())
    async with AsyncExitStack() as stack:
        # (the lookups below ask the server many times in a row: more than its DHT rate limit lets
        # one peer ask, which is not what this test is about)
        fetching, [(_, server)] = await _swarm(stack, loopback_config, model, [WeightServer],
                                               dht_requests_per_peer=100.0, dht_burst_per_peer=1000)
        assert await draft_named_for(fetching, target.model_id, timeout=5) is None
        server.add(draft, listed=False)
        server.add(target, draft=draft.model_id)  # a new card goes out at once
        with trio.fail_after(30):
            while await draft_named_for(fetching, target.model_id, timeout=5) != draft.model_id:
                await trio.sleep(1.0)
        server.add(target)  # (added again, as a peer that moved does: the draft stays named)
        assert server.models[target.model_id][2] == draft.model_id
        kw = dict(vocab_size=1024, model_bytes=target.total_bytes, cache_root=tmp_path / "cache")
        # a draft over half the model's size, or of another vocabulary, is refused before its tensors
        with pytest.raises(fetcher_mod.FetchError, match="over 50% of the model's size"):
            await fetch_draft(fetching, target.model_id, **dict(kw, model_bytes=draft.total_bytes))
        with pytest.raises(fetcher_mod.FetchError, match="vocabulary of 1024 tokens, the model 512"):
            await fetch_draft(fetching, target.model_id, **dict(kw, vocab_size=512))
        assert not Checkpoint(tmp_path / "cache" / draft.model_id).holds(list(draft.catalog))
        path = await fetch_draft(fetching, target.model_id, **kw)
        fetched = Checkpoint(path)
        assert fetched.model_id == draft.model_id and fetched.holds(list(fetched.catalog))
        _same_tensors(path, draft_dir, list(fetched.catalog))
        # a draft is served, not listed: `shardnet models` shows the model alone
        assert [m.card.model_id for m in await list_models(fetching)] == [target.model_id]
