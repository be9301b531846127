"""``ChainCost`` and the fast exact path of ``plan_route`` it enables: the same cheapest cost as
relaxing every edge (the generic path), over random swarms with reported round trips, healing
discounts and relayed peers."""

import random

import pytest

from shardnet.inference.client.routing import (
    KEEP_DISCOUNT,
    RELAYED_RTT_FACTOR,
    SLOW_RTT,
    UNKNOWN_RTT,
    ChainCost,
    link_rtt,
    plan_route,
)
from shardnet.protocols.block_claim import Claim
from shardnet.testing.factories import claim


def test_link_rtt():
    assert link_rtt(0.02) == 0.02
    assert link_rtt(None) == UNKNOWN_RTT
    assert link_rtt(0.02, slow=True) == SLOW_RTT
    assert link_rtt(0.02, relayed=True) == pytest.approx(0.02 * RELAYED_RTT_FACTOR)


def test_chain_cost_hops_and_total():
    costs = ChainCost(lambda peer: {"a": 0.04, "b": 0.06}[peer], kept=frozenset({"b"}))
    a = claim(peer="a", start=0, end=2, tput=50.0, rtts=(("b", 0.01),))
    b = claim(peer="b", start=2, end=4, tput=100.0)
    assert costs.hop(None, a) == pytest.approx(0.02 + 0.02)
    assert costs.hop(a, b) == pytest.approx(0.005 + 0.01)  # the round trip a reported
    assert costs.step(a, b) == pytest.approx(0.015 * KEEP_DISCOUNT)
    assert costs.total([a, b]) == pytest.approx(0.04 + 0.015 + 0.03)
    assert costs.transport([a, b]) == pytest.approx(0.02 + 0.005 + 0.03)  # the round trips alone
    # a client's own reckoning of a peer's throughput replaces its claim's
    assert ChainCost(lambda peer: 0.0, tput=lambda c: 25.0).hop(None, a) == pytest.approx(1 / 25)


def random_swarm(rng: random.Random, peers: int, layers: int) -> tuple[list[Claim], dict[str, float]]:
    spans = []
    for i in range(peers):
        n = rng.randint(1, max(1, layers // 3))
        s = rng.randrange(0, layers - n + 1)
        spans.append((f"p{i}", s, s + n))
    out = []
    for peer, s, e in spans:
        after = [p for p, s2, _ in spans if s2 == e]
        reported = tuple((p, rng.uniform(0.001, 0.2)) for p in rng.sample(after, min(len(after), 4)))
        out.append(claim(peer=peer, start=s, end=e, tput=rng.uniform(1, 100), rtts=reported))
    for layer in range(layers):  # every layer served, so a route exists
        out.append(claim(peer=f"q{layer}", start=layer, end=layer + 1, tput=rng.uniform(1, 100)))
    return out, {c.peer: rng.uniform(0.001, 0.3) for c in out}


@pytest.mark.parametrize("seed", range(30))
def test_the_fast_path_finds_a_chain_as_cheap_as_relaxing_every_edge(seed):
    rng = random.Random(seed)
    layers = rng.randint(2, 12)
    claims, rtt = random_swarm(rng, rng.randint(3, 60), layers)
    kept = frozenset(rng.sample([c.peer for c in claims], 3))
    costs = ChainCost(rtt.__getitem__, lambda p: 2.0 if p.endswith("7") else 1.0, kept)
    fast = plan_route(claims, layers, cost=costs, rng=random.Random(1))
    slow = plan_route(claims, layers, cost=lambda prev, c: costs.step(prev, c), finish=costs.finish,
                      rng=random.Random(1))

    def weighed(route):
        prev, total = None, 0.0
        for c in route:
            total += costs.step(prev, c)
            prev = c
        return total + costs.finish(route[-1])

    assert [c.start for c in fast][0] == 0 and fast[-1].end == layers
    assert all(a.end == b.start for a, b in zip(fast, fast[1:]))
    assert weighed(fast) == pytest.approx(weighed(slow), rel=1e-12)


def test_probe_order_measures_the_unmeasured_first_then_the_stalest():
    from shardnet.inference.client.routing import probe_order

    peers = ["a", "b", "c", "d", "e", "a"]
    assert probe_order(peers, {}, 3) == ["a", "b", "c"]
    assert probe_order(peers, {"a": 5.0, "b": 1.0, "c": 9.0}, 3) == ["d", "e", "b"]
    # over successive routes every peer of a swarm larger than the budget gets measured
    probed: dict[str, float] = {}
    for t in range(4):
        for p in probe_order([f"p{i}" for i in range(10)], probed, 3):
            probed[p] = float(t)
    assert len(probed) == 10


def test_a_loaded_peer_costs_more_and_a_full_one_most():
    from dataclasses import replace

    costs = ChainCost(lambda peer: 0.02)
    idle = claim(peer="a", start=0, end=4, tput=100.0)
    assert costs.hop(None, replace(idle, load=0.5)) == pytest.approx(0.01 + 0.02)
    full = costs.hop(None, replace(idle, load=1.0))
    assert full == pytest.approx(0.01 + 0.01 / 0.05)
    busy, free = replace(idle, peer="b", load=0.99), claim(peer="c", start=0, end=4, tput=50.0)
    assert plan_route([busy, free], 4, cost=costs)[0].peer == "c"
