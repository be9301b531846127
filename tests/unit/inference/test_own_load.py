"""``OwnLoad``: routing counts this node's own open sessions on a peer, however old its claim."""

from functools import partial

from shardnet.inference.client.own_load import OwnLoad
from shardnet.inference.client.routing import ChainCost, plan_route
from shardnet.testing import factories


claim = partial(factories.claim, kv_tokens=1000, tput=100.0)


def test_a_peers_load_is_at_least_the_share_our_sessions_hold():
    own = OwnLoad()
    a = claim(peer="a", kv_tokens=750, load=0.25)  # a budget of 1000 tokens
    assert own.load(a) == 0.25
    with own.holding([a], 500):
        assert own.load(a) == 0.5
        with own.holding([a], 700):
            assert own.load(a) == 1.0
    assert own.load(a) == 0.25 and not own.tokens
    assert own.load(claim(peer="full", kv_tokens=0, load=1.0)) == 1.0


def test_requests_spread_over_equal_chains_as_our_sessions_fill_one():
    own = OwnLoad()
    a, b = claim(peer="a", tput=110.0), claim(peer="b", tput=100.0)
    costs = ChainCost(lambda peer: 0.01, load=own.load)
    assert plan_route([a, b], 4, cost=costs)[0].peer == "a"
    with own.holding([a], 500):  # half of a's budget: its compute counts double
        assert plan_route([a, b], 4, cost=costs)[0].peer == "b"
