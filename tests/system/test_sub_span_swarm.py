"""Chains that enter a span at any layer (issue 39), through real peer processes: four peers
whose spans overlap (0:5, 3:8, 0:3, 5:8) on loopback, clients that route with sub-spans
(``plan_route(..., sub_spans=True)``), and a peer killed with SIGKILL by PID mid-generation
healed onto parts of the others' spans. Every output is single-process transformers' greedy
output on the same weights."""

import os
import signal

import pytest
import trio

from shardnet.inference.client.client import Client
from shardnet.inference.client.routing import narrowed
from shardnet.inference.model.local_model import LocalModel
from shardnet.models import default_model_path
from shardnet.testing.helpers import loopback_config
from shardnet.testing.localswarm import LocalSwarm
from shardnet.transport import open_node

pytestmark = pytest.mark.slow

PROMPT = "def main(args):\n    "
NEW = 16
SPANS = [(0, 5), (3, 8), (0, 3), (5, 8)]  # (the tests kill peers: they run in file order)


@pytest.fixture(scope="module")
def swarm():
    """(bootstrap address, {span: (process, peer_id)}) for the four peers, all serving."""
    with LocalSwarm() as s:
        s.start_bootstrap()
        procs = {span: s.spawn_node(f"p{span[0]}-{span[1]}", "--layers", f"{span[0]}:{span[1]}", "--threads", "1",
                                    command="join") for span in SPANS}
        yield s.bootstrap_addr, {span: (p, s.wait_ready(p, 120)["peer_id"]) for span, p in procs.items()}


def kill_span(peers, span):
    p, _ = peers.pop(span)
    os.kill(p.pid, signal.SIGKILL)
    p.proc.wait(10)


async def generate_greedy(bootstrap, *, route_of=None, kill_when=None):
    """Greedy tokens, the client's stats and the chain it ended on. ``route_of(claims by peer)``:
    the first chain (else the planner's); ``kill_when(tokens so far)``: a span whose peer to kill."""
    async with open_node(loopback_config(bootstrap=[bootstrap], dht_mode="client")) as node:
        await node.wait_bootstrapped()
        client = Client(node, LocalModel(default_model_path()), route_timeout=30, audit_rate=0.0)
        route = None
        if route_of is not None:
            claims = {c.peer: c for c in await client.planner.usable_claims()}
            route = route_of(claims)
        got = []
        with trio.fail_after(240):
            async for tok in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False, route=route):
                got.append(tok.id)
                if kill_when is not None:
                    kill_when(len(got))
        return got, client.last_stats


def _ranges(chain):
    return [(c.start, c.end) for c in chain]


async def test_the_planners_route_and_chains_cut_many_ways_equal_transformers(swarm, reference):
    bootstrap, peers = swarm
    by_span = {span: pid for span, (_, pid) in peers.items()}
    got, stats = await generate_greedy(bootstrap)
    assert got == reference, _ranges(stats.chain)
    # chains cut many ways the four spans allow: two peers each run part of theirs; three hops,
    # one of them strictly inside its peer's span; the only whole-span tilings
    cuts = [[((0, 5), 0, 4), ((3, 8), 4, 8)], [((0, 3), 0, 3), ((0, 5), 3, 5), ((5, 8), 5, 8)],
            [((0, 3), 0, 3), ((3, 8), 3, 6), ((5, 8), 6, 8)], [((0, 5), 0, 1), ((0, 3), 1, 3), ((3, 8), 3, 8)],
            [((0, 5), 0, 2), ((0, 3), 2, 3), ((3, 8), 3, 8)], [((0, 3), 0, 3), ((3, 8), 3, 8)],
            [((0, 5), 0, 5), ((5, 8), 5, 8)]]
    for cut in cuts:
        got, stats = await generate_greedy(bootstrap, route_of=lambda claims, cut=cut: [
            narrowed(claims[by_span[span]], a, b) for span, a, b in cut])
        assert _ranges(stats.chain) == [(a, b) for _, a, b in cut]
        assert got == reference, cut


async def test_a_peer_killed_mid_decode_heals_onto_parts_of_spans(swarm, reference):
    """With the 0:3 peer gone, a chain 0:5 -> 5:8 loses its 5:8 peer after 6 tokens: only parts
    of 0:5 and 3:8 cover the model now (no whole-span tiling is left), and the healed chain
    gives transformers' text."""
    bootstrap, peers = swarm
    kill_span(peers, (0, 3))
    first, last = peers[(0, 5)][1], peers[(5, 8)][1]

    def when(n):
        if n == 6 and (5, 8) in peers:
            kill_span(peers, (5, 8))

    got, stats = await generate_greedy(bootstrap, route_of=lambda claims: [claims[first], claims[last]], kill_when=when)
    assert (5, 8) not in peers and stats.heals, "the 5:8 peer was killed and the chain healed"
    assert got == reference
    healed = stats.chain
    assert [c.peer for c in healed] == [first, peers[(3, 8)][1]] and healed[0].start == 0 and healed[-1].end == 8
    assert healed[0].end == healed[1].start and 3 <= healed[0].end <= 5
