"""Prefix reuse through a real 2-peer chain (issue 35): a chat's second turn reuses the pages every
block cached for its first, a prompt that differs anywhere reuses nothing from there on, a
private scope is not reused by another client, a shared one is, and output always equals
single-process transformers in float32."""

from contextlib import AsyncExitStack

import pytest
import trio

from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.server.compute_peer import serve_block
from shardnet.inference.server.prefix_store import PAGE
from shardnet.models import default_model_path
from shardnet.testing.factories import random_prompts
from shardnet.testing.helpers import chain_token_ids, transformers_reference
from shardnet.transport import open_node

NEW = 6


async def _prefix_chain(stack, loopback_config, kv_budget_bytes=512 << 20):
    boot = await stack.enter_async_context(open_node(loopback_config()))
    cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
    served = []
    for a, b in [(0, 4), (4, 8)]:
        node = await stack.enter_async_context(open_node(cfg))
        served.append(await stack.enter_async_context(serve_block(
            node, str(default_model_path()), a, b, dtype="float32", kv_budget_bytes=kv_budget_bytes)))

    async def client(prefix):
        node = await stack.enter_async_context(open_node(cfg))
        await node.wait_bootstrapped()
        return Client(node, model, audit_rate=0.0, prefix=prefix)

    model = LocalModel(default_model_path(), dtype="float32")
    return served, client


def hits(served) -> list[int]:
    return [s.kv.prefixes.stats.hit_pages for s in served]


def expected(prompt: list[int]) -> list[int]:
    return transformers_reference(default_model_path(), prompt, NEW)[0]


async def test_a_second_turn_reuses_the_first_on_every_block(loopback_config):
    first = random_prompts(1, seed=3, vocab=500, lengths=(3 * PAGE + 10, 3 * PAGE + 11))[0]
    async with AsyncExitStack() as stack:
        served, client_of = await _prefix_chain(stack, loopback_config)
        client = await client_of("t")
        with trio.fail_after(120):
            out1 = await chain_token_ids(client, first, NEW)
            assert out1 == expected(first)
            assert hits(served) == [0, 0]
            assert all(len(s.kv.prefixes) >= 3 for s in served)
            second = first + out1 + [7, 8, 9]
            out2 = await chain_token_ids(client, second, NEW)
        assert out2 == expected(second)
        # every full page of the first turn's prompt and output, on both blocks
        assert hits(served) == [(len(first) + NEW - 1) // PAGE] * 2
        assert all(s.kv.held == s.kv.prefixes.nbytes for s in served)  # sessions gone, pages kept


async def test_a_prompt_that_differs_reuses_only_the_pages_before_the_difference(loopback_config):
    base = random_prompts(1, seed=4, vocab=500, lengths=(3 * PAGE + 5, 3 * PAGE + 6))[0]
    changed = list(base)
    changed[PAGE + 3] = (changed[PAGE + 3] + 1) % 500  # in the second page
    async with AsyncExitStack() as stack:
        served, client_of = await _prefix_chain(stack, loopback_config)
        client = await client_of("t")
        with trio.fail_after(120):
            await chain_token_ids(client, base, NEW)
            got = await chain_token_ids(client, changed, NEW)
        assert got == expected(changed)
        assert hits(served) == [1, 1]  # the first page only


@pytest.mark.parametrize("scope, reused", [("mine", False), ("shared", True)])
async def test_a_private_scope_is_not_reused_by_another_client(loopback_config, scope, reused):
    prompt = random_prompts(1, seed=5, vocab=500, lengths=(2 * PAGE + 5, 2 * PAGE + 6))[0]
    async with AsyncExitStack() as stack:
        served, client_of = await _prefix_chain(stack, loopback_config)
        alice, bob = await client_of(scope), await client_of(scope)
        with trio.fail_after(120):
            await chain_token_ids(alice, prompt, NEW)
            got = await chain_token_ids(bob, prompt, NEW)
        assert got == expected(prompt)
        assert (hits(served) == [2, 2]) is reused
        assert (hits(served) == [0, 0]) is not reused


async def test_without_a_scope_nothing_is_kept(loopback_config):
    prompt = random_prompts(1, seed=6, vocab=500, lengths=(2 * PAGE + 5, 2 * PAGE + 6))[0]
    async with AsyncExitStack() as stack:
        served, client_of = await _prefix_chain(stack, loopback_config)
        client = await client_of(None)
        with trio.fail_after(120):
            await chain_token_ids(client, prompt, NEW)
        assert [len(s.kv.prefixes) for s in served] == [0, 0]


async def test_pages_give_way_to_sessions_when_the_budget_is_short(loopback_config):
    prompts = random_prompts(3, seed=8, vocab=500, lengths=(2 * PAGE + 5, 2 * PAGE + 6))
    async with AsyncExitStack() as stack:
        served, client_of = await _prefix_chain(stack, loopback_config)
        for s in served:  # room for one session of these and two pages more
            per_token = s.block.kv_bytes_per_token()
            page = PAGE * (per_token + 4 * s.block.config.hidden_size)  # keys and values, output rows
            s.kv.limit = per_token * (len(prompts[0]) + NEW + 1) + 2 * page
        client = await client_of("t")
        with trio.fail_after(120):
            for p in prompts:
                assert await chain_token_ids(client, p, NEW) == expected(p)
        for s in served:
            assert s.kv.held <= s.kv.limit
            assert s.kv.prefixes.stats.evicted_pages > 0
