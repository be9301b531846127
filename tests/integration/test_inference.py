"""Sharded inference against single-process transformers, on real hosts over loopback."""

from contextlib import AsyncExitStack

import pytest
import torch
import trio

from shardnet.errors import InferenceError
from shardnet.inference.client.client import Client
from shardnet.inference.model.block import Block, Head
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.layout import split_layers
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.inference.server.compute_peer import serve_block
from shardnet.testing.helpers import (
    EXACT_NEW_TOKENS,
    EXACT_PROMPT,
    LOGIT_TOL,
    chain_token_ids,
    local_chain,
    transformers_reference,
)
from shardnet.testing.helpers import chain_last_logits as last_logits
from shardnet.transport import open_node

PROMPT, NEW_TOKENS = EXACT_PROMPT, EXACT_NEW_TOKENS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    # mistral with a 5-token sliding window, so the sliding-window masks are exercised;
    # qwen2 split over two weight files (an index), with non-zero q/k/v biases
    return {fam: init_random(root / fam, fam, layers=4, hidden=64, heads=4, kv_heads=2, vocab=512, seed=seed,
                             shards=2 if fam == "qwen2" else 1, sliding_window=5 if fam == "mistral" else None)
            for fam, seed in (("llama", 11), ("mistral", 12), ("qwen2", 13), ("qwen3", 14))}


swarm = local_chain


async def generate_ids(client, prompt=PROMPT, new=NEW_TOKENS, **kw):
    return await chain_token_ids(client, prompt, new, **kw)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("peers", [1, 2, 3, 4])
async def test_greedy_output_matches_transformers(loopback_config, checkpoints, family, peers):
    path = checkpoints[family]
    want_ids, want_logits = transformers_reference(path, PROMPT, NEW_TOKENS)
    async with swarm(loopback_config, path, split_layers(4, peers)) as node:
        client = Client(node, LocalModel(path))
        got = await generate_ids(client)
        assert got == want_ids
        assert [(c.start, c.end) for c in client.last_stats.chain] == split_layers(4, peers)
        logits = await last_logits(client, PROMPT + got)
    assert torch.allclose(logits, want_logits, atol=LOGIT_TOL, rtol=0), (logits - want_logits).abs().max()


async def test_lm_head_on_the_last_peer(loopback_config, checkpoints):
    path = checkpoints["llama"]
    want_ids, want_logits = transformers_reference(path, PROMPT, NEW_TOKENS)
    async with swarm(loopback_config, path, [(0, 2), (2, 4)], hold_head=True) as node:
        client = Client(node, LocalModel(path, lm_head=False), logits_on_last=True)
        assert client.model.head.lm_weight is None  # the thin client really has no LM head
        assert await generate_ids(client) == want_ids
        logits = await last_logits(client, PROMPT + want_ids)
    assert torch.allclose(logits, want_logits, atol=LOGIT_TOL, rtol=0)


async def test_two_clients_at_once_are_isolated(loopback_config, checkpoints):
    path = checkpoints["qwen2"]
    prompts = [PROMPT, [5, 6, 7, 8, 9, 200, 300, 400, 12]]
    wants = [transformers_reference(path, p, NEW_TOKENS)[0] for p in prompts]
    assert wants[0] != wants[1]
    async with swarm(loopback_config, path, [(0, 1), (1, 3), (3, 4)]) as node:
        model = LocalModel(path)
        results = [None, None]

        async def run(i):
            results[i] = await generate_ids(Client(node, model), prompts[i])

        async with trio.open_nursery() as n:
            n.start_soon(run, 0)
            n.start_soon(run, 1)
    assert results == wants


async def test_sampling_is_seeded_and_reproducible(loopback_config, checkpoints):
    path = checkpoints["llama"]
    async with swarm(loopback_config, path, [(0, 4)]) as node:
        client = Client(node, LocalModel(path))
        a = await generate_ids(client, temperature=1.0, top_k=50, top_p=0.9, seed=7)
        b = await generate_ids(client, temperature=1.0, top_k=50, top_p=0.9, seed=7)
        c = await generate_ids(client, temperature=1.0, top_k=50, top_p=0.9, seed=8)
    assert a == b and a != c


async def test_kv_budget_is_an_error_reply_not_a_crash(loopback_config, checkpoints):
    path = checkpoints["llama"]
    per_token = Block(Checkpoint(path), 0, 4).kv_bytes_per_token()
    async with swarm(loopback_config, path, [(0, 4)], kv_budget_bytes=per_token * 30) as node:
        client = Client(node, LocalModel(path))
        with pytest.raises(InferenceError, match="kv_budget") as refused:
            await generate_ids(client, new=40)  # 7 + 40 tokens > 30
        # the refusal's figures came on the wire: more than the whole budget, so no use waiting
        assert refused.value.limit_bytes == per_token * 30 < refused.value.need_bytes
        assert len(await generate_ids(client, new=10)) == 10  # still serving


async def test_missing_layers_are_named(loopback_config, checkpoints):
    from shardnet.errors import NoRouteError

    path = checkpoints["llama"]
    async with swarm(loopback_config, path, [(0, 2)]) as node:
        client = Client(node, LocalModel(path))
        with pytest.raises(NoRouteError, match=r"no live peer serves layers 2-3 \(model has 4 layers"):
            await client.planner.find_route(timeout=3)


def test_block_loads_only_its_tensors(checkpoints, monkeypatch):
    ck = Checkpoint(checkpoints["llama"])
    loaded = []
    orig = Checkpoint.load

    def spy(self, names, **kw):
        loaded.extend(names)
        return orig(self, names, **kw)

    monkeypatch.setattr(Checkpoint, "load", spy)
    Block(ck, 1, 3)
    assert loaded and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in loaded)
    assert set(loaded) == set(ck.layer_tensors(1) + ck.layer_tensors(2))
    loaded.clear()
    Head(ck)
    assert set(loaded) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


async def test_idle_sessions_expire_and_free_their_kv(loopback_config, checkpoints):
    path = checkpoints["llama"]
    async with AsyncExitStack() as stack:
        peer = await stack.enter_async_context(open_node(loopback_config()))
        info = await stack.enter_async_context(serve_block(peer, str(path), 0, 4, idle_timeout=0.5))
        node = await stack.enter_async_context(open_node(loopback_config()))
        await node.connect(peer.listen_addrs[0])
        from shardnet.inference.claims import fetch_claims

        client = Client(node, LocalModel(path), route=await fetch_claims(node, str(peer.peer_id)))
        async with client.session(16) as sess:
            await sess.forward(client.model.head.embed(torch.tensor([[1, 2, 3]])))
            assert info.kv.used > 0
            await trio.sleep(1.5)
            with pytest.raises(InferenceError, match="idle"):
                await sess.forward(client.model.head.embed(torch.tensor([[4]])))
        assert info.kv.used == 0
