"""``plan_route(..., sub_spans=True)`` (issue 39, the planner's first step): claims that say
``sub_spans`` may be cut at any boundary where another claim starts or ends, so a route exists
where no tiling of whole spans does, the cheapest cut wins, and claims of peers that run whole
spans only are never cut. (Clients do not route this way yet.)"""

import random

import pytest

from shardnet.errors import NoRouteError
from shardnet.inference.client.routing import ChainCost, narrowed, plan_route
from shardnet.testing.factories import claim


def _spans(route):
    return [(c.peer, c.start, c.end) for c in route]


def test_only_sub_spans_tile_the_model():
    """0:5 and 3:8 overlap: no whole-span route, but 0:3 + 3:8 or 0:5 + 5:8 (fewest hops: two)."""
    cs = [claim(peer="a", start=0, end=5, sub_spans=True), claim(peer="b", start=3, end=8, sub_spans=True)]
    with pytest.raises(NoRouteError):
        plan_route(cs, 8)
    routes = {tuple(_spans(plan_route(cs, 8, sub_spans=True, rng=random.Random(s)))) for s in range(20)}
    assert routes == {(("a", 0, 3), ("b", 3, 8)), (("a", 0, 5), ("b", 5, 8))}


def test_a_claim_without_sub_spans_is_never_cut():
    cs = [claim(peer="a", start=0, end=5), claim(peer="b", start=3, end=8, sub_spans=True)]
    assert _spans(plan_route(cs, 8, sub_spans=True)) == [("a", 0, 5), ("b", 5, 8)]
    with pytest.raises(NoRouteError):  # and a route that needs it cut does not exist
        plan_route([claim(peer="a", start=0, end=5), claim(peer="b", start=3, end=8)], 8, sub_spans=True)


def test_the_cheaper_peer_runs_as_many_layers_as_it_can():
    """Compute is priced per layer: a fast peer (tput 1000 over its 5 layers) takes every layer it
    can, the slow one (tput 10 over its 5) only what the fast one lacks."""
    fast = claim(peer="fast", start=0, end=5, tput=1000.0, sub_spans=True)
    slow = claim(peer="slow", start=3, end=8, tput=10.0, sub_spans=True)
    costs = ChainCost(lambda peer: 0.01)
    assert _spans(plan_route([fast, slow], 8, cost=costs, sub_spans=True)) == [("fast", 0, 5), ("slow", 5, 8)]
    # reversed speeds: the slow peer runs the fewest layers it can
    fast2 = claim(peer="fast", start=3, end=8, tput=1000.0, sub_spans=True)
    slow2 = claim(peer="slow", start=0, end=5, tput=10.0, sub_spans=True)
    assert _spans(plan_route([fast2, slow2], 8, cost=costs, sub_spans=True)) == [("slow", 0, 3), ("fast", 3, 8)]


def test_a_narrowed_claim_scales_its_tokens_per_second_to_its_layers():
    c = claim(peer="a", start=2, end=8, tput=30.0, sub_spans=True, loading=(0, 4))
    n = narrowed(c, 4, 6)
    assert (n.start, n.end, n.peer, n.loading) == (4, 6, "a", None) and n.tput == pytest.approx(90.0)
    assert narrowed(c, 2, 8) is c
    with pytest.raises(ValueError, match="not within the claim's 2:8"):
        narrowed(c, 1, 4)


def test_spans_that_line_up_add_nothing_and_routes_are_unchanged():
    """Where spans tile the model (as placement's windows do), no claim has a cut inside and the
    routes are those of whole spans."""
    cs = [claim(peer=f"p{i}", start=a, end=a + 2, sub_spans=True) for i, a in enumerate((0, 2, 4, 6, 0, 2, 4, 6))]
    for seed in range(10):
        route = plan_route(cs, 8, sub_spans=True, rng=random.Random(seed))
        assert [(c.start, c.end) for c in route] == [(0, 2), (2, 4), (4, 6), (6, 8)]
        assert all(c in cs for c in route)


def _swept(cs, layers, costs):
    """The sweep's cheapest chain before a claim entered twice is merged (what the generic search
    over narrowed claims finds too), narrowed."""
    from shardnet.inference.client.routing import _LayerSweep

    sweep = _LayerSweep([c for c in cs if c.serving], layers, costs)
    return [narrowed(sweep.usable[j], a, e) for j, a, e in sweep.cheapest_hops()]


@pytest.mark.parametrize("seed", range(12))
def test_the_state_planner_finds_a_chain_as_cheap_as_every_narrowed_claim_would(seed):
    """With a ``ChainCost`` the planner walks states inside claims (one per cut); the generic path
    prices every narrowed claim (every pair of cuts) with the same cost: the same cheapest cost,
    over random swarms with reported round trips, kept peers and claims that run whole spans only."""
    rng = random.Random(seed)
    layers, peers = 12, [f"p{i}" for i in range(14)]
    cs = []
    for i, peer in enumerate(peers):
        k = rng.randint(1, 6)
        a = rng.randrange(0, layers - k + 1)
        rtts = tuple((rng.choice(peers), rng.uniform(0.001, 0.05)) for _ in range(3))
        cs.append(claim(peer=peer, start=a, end=a + k, tput=rng.uniform(5, 100), sub_spans=rng.random() < 0.8,
                        rtts=rtts, load=rng.uniform(0, 0.5)))
    cs.append(claim(peer="first", start=0, end=3, sub_spans=True))  # (so some route exists)
    cs.append(claim(peer="last", start=3, end=layers, sub_spans=True))
    rtt = {p: rng.uniform(0.005, 0.08) for p in peers + ["first", "last"]}
    costs = ChainCost(lambda p: rtt[p], kept=frozenset(rng.sample(peers, 2)))
    fast = _swept(cs, layers, costs)
    slow = plan_route(cs, layers, cost=lambda prev, c: costs.step(prev, c), finish=costs.finish, sub_spans=True,
                      rng=random.Random(1))

    def weighed(route):  # as routing weighs a chain: ChainCost.step per hop, then the return
        return sum(costs.step(p, c) for p, c in zip([None, *route], route)) + costs.finish(route[-1])

    assert weighed(fast) == pytest.approx(weighed(slow), rel=1e-9)
    planned = plan_route(cs, layers, cost=costs, sub_spans=True, rng=random.Random(1))
    assert len({c.peer for c in planned}) == len(planned) and weighed(planned) >= weighed(fast) * (1 - 1e-9)
    assert [c.start for c in fast][0] == 0 and fast[-1].end == layers
    assert all(a.end == b.start for a, b in zip(fast, fast[1:]))
    by_peer = {c.peer: c for c in cs}
    assert all(by_peer[c.peer].start <= c.start < c.end <= by_peer[c.peer].end for c in fast)
    assert all((c.start, c.end) == (by_peer[c.peer].start, by_peer[c.peer].end)
               for c in fast if not by_peer[c.peer].sub_spans)


@pytest.mark.parametrize("seed", range(8))
def test_the_layer_sweep_is_exact_where_every_peer_reported_on_most_others(seed):
    """The sweep takes an entry's cheapest source among the few cheapest hops ending at its
    boundary unless they all reported on the entered peer (then a reported round trip, or a
    source further down): with most peers reporting on most others, it still finds the cost the
    narrowed claims' generic search finds."""
    rng = random.Random(100 + seed)
    layers, peers = 10, [f"p{i}" for i in range(12)]
    cs = []
    for peer in peers:
        k = rng.randint(1, 5)
        a = rng.randrange(0, layers - k + 1)
        rtts = tuple((other, rng.uniform(0.001, 0.2)) for other in peers if other != peer and rng.random() < 0.9)
        cs.append(claim(peer=peer, start=a, end=a + k, tput=rng.uniform(5, 100), sub_spans=rng.random() < 0.7,
                        rtts=rtts))
    cs += [claim(peer="first", start=0, end=4, sub_spans=True, rtts=tuple((p, 0.3) for p in peers)),
           claim(peer="last", start=4, end=layers, sub_spans=True)]
    rtt = {p: rng.uniform(0.005, 0.08) for p in peers + ["first", "last"]}
    costs = ChainCost(lambda p: rtt[p])
    fast = _swept(cs, layers, costs)
    slow = plan_route(cs, layers, cost=lambda prev, c: costs.step(prev, c), finish=costs.finish, sub_spans=True,
                      rng=random.Random(seed))

    def weighed(route):
        return sum(costs.step(p, c) for p, c in zip([None, *route], route)) + costs.finish(route[-1])

    assert weighed(fast) == pytest.approx(weighed(slow), rel=1e-9)
    planned = plan_route(cs, layers, cost=costs, sub_spans=True, rng=random.Random(seed))
    assert len({c.peer for c in planned}) == len(planned) and weighed(planned) >= weighed(fast) * (1 - 1e-9)
    fast = planned
    assert fast[0].start == 0 and fast[-1].end == layers and all(a.end == b.start for a, b in zip(fast, fast[1:]))


def test_a_chain_never_enters_one_claim_twice():
    """A slow peer (20 ms a layer over 0:3) and a fast one serving layer 1 only: entering the slow
    one twice around the fast one (0:1, 1:2, 2:3) would be cheapest, but a peer holds one session
    per request: the slow peer runs 0:3 in one hop."""
    slow = claim(peer="slow", start=0, end=3, tput=1 / 0.06, sub_spans=True, rtts=(("fast", 0.002),))
    fast = claim(peer="fast", start=1, end=2, tput=200.0, sub_spans=True, rtts=(("slow", 0.002),))
    for seed in range(5):
        route = plan_route([slow, fast], 3, cost=ChainCost(lambda peer: 0.002), sub_spans=True,
                           rng=random.Random(seed))
        assert [(c.peer, c.start, c.end) for c in route] == [("slow", 0, 3)]
