"""Continuous batching on compute peers (``join --batch-tokens``): concurrent sessions of
different prompts and lengths, plain and speculative, through a 2- and a 3-peer chain; each
session's greedy output equals its output alone, and the peers did run several sessions' steps
in one forward pass."""


import pytest

from shardnet.inference.client.client import Client
from shardnet.inference.client.speculative import NGramDrafter
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.server.compute_peer import serve_block
from shardnet.models import default_model_path
from shardnet.testing.factories import random_prompts
from shardnet.testing.helpers import assert_greedy_texts, chain_token_ids, each_at_once
from shardnet.transport import open_node

NEW = 10


async def _chain(stack, loopback_config, ranges, batch_tokens):
    boot = await stack.enter_async_context(open_node(loopback_config()))
    cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
    served = []
    for a, b in ranges:
        node = await stack.enter_async_context(open_node(cfg))
        served.append(await stack.enter_async_context(serve_block(node, str(default_model_path()), a, b,
                                                                  dtype="float32", batch_tokens=batch_tokens)))
    client_node = await stack.enter_async_context(open_node(cfg))
    await client_node.wait_bootstrapped()
    return client_node, served


@pytest.mark.parametrize("ranges", [[(0, 4), (4, 8)], [(0, 3), (3, 5), (5, 8)]])
async def test_concurrent_sessions_batched_equal_each_alone(loopback_config, ranges):
    from contextlib import AsyncExitStack

    # float32: batching changes the order of additions, which may turn a float16 near-tie (the top
    # two logits equal in float16) either way; in float32 the ties are far rarer than a test's tokens
    model = LocalModel(default_model_path(), dtype="float32")
    ps = random_prompts(16, seed=7, vocab=500, lengths=(2, 40))
    async with AsyncExitStack() as stack:
        client_node, served = await _chain(stack, loopback_config, ranges, batch_tokens=64)
        client = Client(client_node, model, audit_rate=0.0)
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            kw = {"drafter": NGramDrafter(), "k": 3, "depth": 2} if i % 3 == 0 else {}
            got[i] = await chain_token_ids(client, ps[i], NEW, **kw)

        await each_at_once(len(ps), one, 240)
        assert_greedy_texts(got, ps, NEW)  # each equals the model run alone on its prompt, in one process
        stats = [s.scheduler.stats for s in served]
        assert all(s.largest > 1 for s in stats), stats  # steps of several sessions ran together
        assert all(s.tokens <= s.passes * 64 for s in stats)  # within the token budget
