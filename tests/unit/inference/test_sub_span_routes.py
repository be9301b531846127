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
