"""What routing counts of a claimed throughput (peer_speeds.py): a peer never observed at most as
its layers' typical peer, an observed one at most as fast as it was seen, and one whose claim its
observed speed belies is marked (reputation.py) and routed around."""

import random

import pytest

from shardnet.inference.client.peer_speeds import (
    FORGET_S,
    OVERCLAIM_FACTOR,
    PeerSpeeds,
    typical_tput,
)
from shardnet.inference.client.reputation import OVERCLAIM_COST_FACTOR, Reputation
from shardnet.inference.client.routing import ChainCost, plan_route
from shardnet.protocols.block_claim import Claim
from shardnet.testing.factories import claim

RTT = 0.002


# layers 0:4 on A; 4:8 on two honest peers and L, which announces 400 times their throughput
A, B, C, L = claim(peer="A", start=0, end=4, tput=250.0), claim(peer="B", start=4, end=8, tput=250.0), claim(peer="C", start=4, end=8, tput=250.0), claim(peer="L", start=4, end=8, tput=1e5)
SWARM = [A, B, C, L]
PRIOR = typical_tput(SWARM)


def first_hops_at_4(costs: ChainCost, routes: int = 300) -> dict[str, int]:
    out: dict[str, int] = {}
    for seed in range(routes):
        route = plan_route(SWARM, 8, cost=costs, rng=random.Random(seed))
        out[route[1].peer] = out.get(route[1].peer, 0) + 1
    return out


def step_time(route: list[Claim], true_tput: dict[str, float], overhead: float = 1.5) -> float:
    """A step as the client would see it: round trips and each peer's true compute, all some
    common factor slower than estimated (the client's own overhead)."""
    return overhead * (RTT * (len(route) + 1) / 2 + sum(1 / true_tput[c.peer] for c in route))


def test_typical_tput_is_the_median_claim_per_layer_of_a_claims_layers():
    half = claim(peer="D", start=4, end=6, tput=500.0)  # 2 layers at 500 tok/s: 1000 layer-tokens/s, as a 4-layer peer at 250
    loading = claim(peer="E", start=4, end=8, tput=1e9, loading=(4, 8))  # not serving yet: not counted
    prior = typical_tput([A, B, C, L, half, loading, claim(peer="Z", start=0, end=4, tput=0.0)])
    assert prior(L) == 250.0  # layers 4-7: [1000, 1000, 1000, 4e5] and [1000, 1000, 4e5]: the lower middle
    assert prior(half) == 500.0  # the same per layer, for a span half as long
    assert prior(A) == 250.0  # alone on its layers (Z claims no figure): its own claim
    assert typical_tput([B, L])(L) == 250.0  # the other peer's
    # the others' median: its own claim does not raise the bar (of [200, 300, 1e5], 300 would be)
    assert typical_tput([claim(peer="B", start=4, end=8, tput=200.0), claim(peer="C", start=4, end=8, tput=300.0), L])(L) == 200.0
    assert typical_tput([])(L) == 1e5


def test_a_peer_never_observed_counts_as_the_typical_peer_of_its_layers():
    trusted = first_hops_at_4(ChainCost(lambda peer: RTT))
    assert trusted == {"L": 300}  # believing claims, the over-announcer takes every first route
    speeds = PeerSpeeds()
    assert speeds.routing_tput(PRIOR)(L) == 250.0
    counted = first_hops_at_4(ChainCost(lambda peer: RTT, tput=speeds.routing_tput(PRIOR)))
    assert set(counted) == {"B", "C", "L"} and counted["L"] < 150  # a tie: about a third each
    # a claim of no figure counts as the typical peer too (it used to cost nothing)
    assert speeds.routing_tput(PRIOR)(claim(peer="N", start=4, end=8, tput=0.0)) == 250.0


def test_a_peer_whose_steps_belie_its_claim_is_marked_and_routed_around():
    speeds, reputation = PeerSpeeds(), Reputation()
    true = {"A": 250.0, "B": 250.0, "C": 250.0, "L": 250.0}  # L computes as fast as anyone
    for route in ([A, L], [A, B], [A, L]):
        speeds.observe(route, step_time(route, true), RTT * 3 / 2, PRIOR)
    overclaims = speeds.overclaims()
    assert overclaims["L"] > OVERCLAIM_FACTOR
    assert overclaims["A"] is None and overclaims["B"] is None
    for peer, ratio in overclaims.items():
        reputation.overclaiming(peer, ratio)
    assert reputation.cost_factor("L") == OVERCLAIM_COST_FACTOR and reputation.cost_factor("A") == 1.0
    assert reputation.to_json()["L"]["overclaim"] == overclaims["L"]
    tput = speeds.routing_tput(PRIOR)
    assert tput(L) == 250.0  # back to the typical peer's figure
    assert tput(B) == pytest.approx(250.0)  # observed as claimed
    costs = ChainCost(lambda peer: RTT, reputation.cost_factor, tput=tput)
    assert "L" not in first_hops_at_4(costs)


def test_honest_peers_are_not_marked_and_a_faster_one_earns_its_claim_once_seen():
    fast = claim(peer="F", start=4, end=8, tput=750.0)  # three times the typical peer, and truly so
    swarm = [A, B, C, fast]
    prior = typical_tput(swarm)
    speeds = PeerSpeeds()
    assert speeds.routing_tput(prior)(fast) == 250.0  # not seen yet: as the typical peer
    true = {"A": 250.0, "B": 250.0, "C": 250.0, "F": 750.0}
    for route in ([A, fast], [A, B], [A, C], [A, fast]):
        speeds.observe(route, step_time(route, true), RTT * 3 / 2, prior)
    assert speeds.overclaims() == {"A": None, "B": None, "C": None, "F": None}
    assert speeds.routing_tput(prior)(fast) == pytest.approx(750.0)


def test_an_honest_chain_mate_of_a_slow_peer_recovers_its_standing():
    slow = claim(peer="S", start=4, end=8, tput=250.0)  # claims as the others, computes ten times slower
    swarm = [A, B, C, slow]
    prior = typical_tput(swarm)
    true = {"A": 250.0, "B": 250.0, "C": 250.0, "S": 25.0}
    speeds = PeerSpeeds()
    for route in ([A, B], [A, C]):
        speeds.observe(route, step_time(route, true), RTT * 3 / 2, prior)
    for _ in range(3):
        speeds.observe([A, slow], step_time([A, slow], true), RTT * 3 / 2, prior)
    # the step's time is split between A and S: both look slower than they claim
    assert speeds.overclaims()["S"] is not None and speeds.overclaims()["A"] is not None
    for _ in range(10):
        speeds.observe([A, B], step_time([A, B], true), RTT * 3 / 2, prior)
    assert speeds.overclaims()["A"] is None and speeds.overclaims()["S"] is not None


def test_a_peer_not_observed_for_a_while_is_forgotten():
    now = [0.0]
    speeds = PeerSpeeds(clock=lambda: now[0])
    true = {"A": 250.0, "L": 250.0}
    speeds.observe([A, L], step_time([A, L], true), RTT * 3 / 2, PRIOR)
    speeds.observe([A, B], step_time([A, B], {"A": 250.0, "B": 250.0}), RTT * 3 / 2, PRIOR)
    assert speeds.overclaims()["L"] is not None
    now[0] = FORGET_S - 1
    speeds.observe([A, B], step_time([A, B], {"A": 250.0, "B": 250.0}), RTT * 3 / 2, PRIOR)
    now[0] = FORGET_S + 1
    assert set(speeds.peers) == {"A", "B"}  # L: as if never observed (typical figure, no mark)
