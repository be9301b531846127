"""Sub-span sessions on real peers (issue 39, the compute peer's side): a session may run any
layer range [a, b) within a peer's claimed span, with a KV cache of exactly those layers, and
the chain's output is single-process transformers' greedy output in float32 whichever ranges
the route cuts the peers' spans into. Routes are given to the client here (clients still route whole
spans); the peers are 0:5 and 3:8, so the routes below overlap them differently, and one comes
from `plan_route(..., sub_spans=True)`, the planner's first step towards routing with them."""

from contextlib import AsyncExitStack
from dataclasses import replace

import pytest
import trio

from shardnet.errors import InferenceError
from shardnet.inference.claims import fetch_claims
from shardnet.inference.client.client import Client
from shardnet.inference.client.speculative import NGramDrafter
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.server.compute_peer import serve_block
from shardnet.models import default_model_path
from shardnet.testing.helpers import assert_greedy_texts, chain_token_ids, each_at_once, transformers_reference
from shardnet.transport import open_node

PROMPT = [5, 17, 300, 41, 9, 77, 12]
NEW = 10


async def _two_peers(stack, loopback_config, batch_tokens: int = 64):
    """Peers serving 0:5 and 3:8 in float32, a client connected to both, and each peer's claim."""
    path = str(default_model_path())
    peers, served = [], []
    for a, b in ((0, 5), (3, 8)):
        node = await stack.enter_async_context(open_node(loopback_config()))
        served.append(await stack.enter_async_context(serve_block(node, path, a, b, dtype="float32",
                                                                  batch_tokens=batch_tokens)))
        peers.append(node)
    client_node = await stack.enter_async_context(open_node(loopback_config()))
    claims = []
    for node in peers:
        await client_node.connect(node.listen_addrs[0])
        claims.append((await fetch_claims(client_node, str(node.peer_id)))[0])
    return client_node, claims, served


def _route(claims, *ranges):
    """The peers' claims narrowed to ``ranges`` (one per peer, in chain order)."""
    return [replace(c, start=a, end=b) for c, (a, b) in zip(claims, ranges)]


@pytest.mark.parametrize("cut", [((0, 3), (3, 8)), ((0, 5), (5, 8)), ((0, 4), (4, 8))],
                         ids=["first-sub", "second-sub", "both-sub"])
async def test_a_chain_of_sub_spans_equals_transformers(loopback_config, cut):
    model = LocalModel(default_model_path(), dtype="float32")
    want = transformers_reference(default_model_path(), PROMPT, NEW)[0]
    async with AsyncExitStack() as stack:
        client_node, claims, served = await _two_peers(stack, loopback_config)
        route = _route(claims, *cut)
        client = Client(client_node, model, audit_rate=0.0, route=route)
        with trio.fail_after(120):
            assert await chain_token_ids(client, PROMPT, NEW) == want
            # speculative (verify chunks and rollbacks through the sub-spans' caches)
            assert await chain_token_ids(client, PROMPT, NEW, drafter=NGramDrafter(), k=3, depth=2) == want
        # each peer reserved KV for the layers it ran only, and gave it back
        assert all(sb.kv.used == 0 for sb in served)


async def test_where_only_sub_spans_tile_the_model_the_planner_finds_a_route_that_generates(loopback_config):
    """Spans 0:5 and 3:8 line up nowhere: no route of whole spans exists. The peers' own claims
    say ``sub_spans``; ``plan_route(..., sub_spans=True)`` cuts them, and the route generates
    transformers' text."""
    from shardnet.errors import NoRouteError
    from shardnet.inference.client.routing import plan_route

    model = LocalModel(default_model_path(), dtype="float32")
    async with AsyncExitStack() as stack:
        client_node, claims, served = await _two_peers(stack, loopback_config)
        assert all(c.sub_spans for c in claims)
        with pytest.raises(NoRouteError):
            plan_route(claims, 8)
        route = plan_route(claims, 8, sub_spans=True)
        assert len(route) == 2 and route[0].start == 0 and route[0].end == route[1].start and route[1].end == 8
        client = Client(client_node, model, audit_rate=0.0, route=route)
        with trio.fail_after(120):
            assert await chain_token_ids(client, PROMPT, NEW) == transformers_reference(default_model_path(),
                                                                                        PROMPT, NEW)[0]


async def test_sub_span_and_whole_span_sessions_share_a_peer(loopback_config):
    """Concurrent sessions on the same peers, some through a sub-span route and some through the
    whole spans: each gets transformers' text (a sub-span step runs in a pass of its own, a
    prompt longer than the peers' budget of 64 tokens in chunks; the others may be batched)."""
    from shardnet.testing.factories import random_prompts

    model = LocalModel(default_model_path(), dtype="float32")
    prompts = random_prompts(5, seed=3, vocab=500, lengths=(2, 30)) + random_prompts(1, seed=4, vocab=500,
                                                                                    lengths=(150, 151))
    async with AsyncExitStack() as stack:
        client_node, claims, served = await _two_peers(stack, loopback_config)
        routes = [_route(claims, (0, 4), (4, 8)), _route(claims, (0, 5), (5, 8))]
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            client = Client(client_node, model, audit_rate=0.0, route=routes[i % 2])
            got[i] = await chain_token_ids(client, prompts[i], NEW)

        await each_at_once(len(prompts), one, 180)
        assert_greedy_texts(got, prompts, NEW)


async def test_layers_outside_the_span_are_refused_in_one_line(loopback_config):
    model = LocalModel(default_model_path(), dtype="float32")
    async with AsyncExitStack() as stack:
        client_node, claims, served = await _two_peers(stack, loopback_config)
        client = Client(client_node, model, audit_rate=0.0, route=_route(claims, (0, 6), (6, 8)))
        with trio.fail_after(60), pytest.raises(InferenceError, match=r"layers 0:6 requested; this peer serves 0:5"):
            await chain_token_ids(client, PROMPT, 2)
        assert all(sb.kv.used == 0 for sb in served)
