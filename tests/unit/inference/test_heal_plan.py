"""``plan_heal``: the decision ``HealingSession`` takes when peers of its chain fail (and the
swarm simulator takes the same way): avoid them, keep the rest of the chain, replace their spans;
with ``plan_route`` that replaces exactly the failed span where claims line up with it, and is a
whole new chain where none do."""

from shardnet.inference.client.heal_plan import HealPlan, plan_heal
from shardnet.inference.client.routing import ChainCost, plan_route
from shardnet.testing.factories import claim

A, B, C = claim(peer="a", start=0, end=4), claim(peer="b", start=4, end=8), claim(peer="c", start=8, end=12)


def test_the_failed_peer_is_avoided_and_the_rest_of_the_chain_kept_in_order():
    assert plan_heal([A, B, C], ["b"]) == HealPlan(avoid=frozenset({"b"}), keep=[A, C], replace=[(4, 8)])
    assert plan_heal([A, B, C], {"c", "a"}) == HealPlan(frozenset({"a", "c"}), [B], [(0, 4), (8, 12)])
    assert plan_heal([A, B, C], ["a", "b", "c"]).keep == []


def test_a_failed_peer_outside_the_chain_is_avoided_and_changes_nothing_else():
    assert plan_heal([A, B, C], ["x"]) == HealPlan(frozenset({"x"}), [A, B, C], [])
    assert plan_heal([], ["x"]) == HealPlan(frozenset({"x"}), [], [])


def route(claims, plan: HealPlan) -> list[str]:
    """The chain ``RoutePlanner.find_route(avoid=plan.avoid, keep=plan.keep)`` picks (round trips of 50 ms)."""
    usable = [c for c in claims if c.peer not in plan.avoid]
    kept = frozenset(c.peer for c in plan.keep)
    return [c.peer for c in plan_route(usable, 12, cost=ChainCost(lambda peer: 0.05, kept=kept))]


def test_routed_it_replaces_only_the_failed_span_where_a_claim_lines_up():
    # d serves b's span; e and f make a faster chain, which a fresh route takes
    d = claim(peer="d", start=4, end=8)
    e, f = claim(peer="e", start=0, end=6, tput=12.0), claim(peer="f", start=6, end=12, tput=12.0)
    claims = [A, B, C, d, e, f]
    assert route(claims, HealPlan(frozenset({"b"}), [], [])) == ["e", "f"]
    assert route(claims, plan_heal([A, B, C], ["b"])) == ["a", "d", "c"]


def test_routed_it_is_a_whole_new_chain_where_no_claim_lines_up():
    e, f = claim(peer="e", start=0, end=6), claim(peer="f", start=6, end=12)
    assert route([A, B, C, e, f], plan_heal([A, B, C], ["b"])) == ["e", "f"]
