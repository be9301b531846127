"""RoutePlanner without a network: fake claims view, probes and node."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import trio

from shardnet.errors import NoRouteError
from shardnet.inference.client.own_load import OwnLoad
from shardnet.inference.client.reputation import Reputation
from shardnet.inference.client.route_planner import GONE_RECHECK_S, RTT_CACHE_S, RoutePlanner
from shardnet.inference.client.routing import (
    KEEP_DISCOUNT,
    RELAYED_RTT_FACTOR,
    SLOW_RTT,
    UNKNOWN_RTT,
)
from shardnet.protocols.block_claim import Claim
from shardnet.testing import factories


claim = partial(factories.claim, kv_tokens=1000, tput=0.0)


class FakeNode:
    def __init__(self, relayed: set[str] = frozenset()) -> None:
        self.relayed = relayed

    def link(self, peer: str) -> str:
        return "relayed" if peer in self.relayed else "direct"


class FakeProbes:
    def __init__(self, rtts: dict[str, float] | None = None, verdicts: dict[str, str] | None = None) -> None:
        self.rtts = dict(rtts or {})
        self.verdicts = dict(verdicts or {})
        self.probed: list[tuple[list[str], float]] = []
        self.results: dict = {}
        self.revived: set[str] = set()

    def verdict(self, peer: str) -> str | None:
        return self.verdicts.get(peer)

    async def probe(self, peers, *, max_age, timeout, samples) -> dict:
        """(A peer in ``revived`` answers now, whatever its verdict was.)"""
        self.probed.append((list(peers), max_age))
        for peer in set(peers) & self.revived:
            self.verdicts[peer] = "alive"
        return {peer: SimpleNamespace(verdict=self.verdicts.get(peer, "alive")) for peer in peers}


class FakeView:
    """A view without a background task: ``find_route`` looks up itself."""

    def __init__(self, claims: list[Claim]) -> None:
        self.claims = claims
        self.running = False
        self.lookups = 0
        self.last_lookup_error: str | None = None

    def start(self) -> None:
        pass

    def kick(self) -> None:
        pass

    async def lookup(self, timeout: float) -> None:
        self.lookups += 1

    def current(self) -> list[Claim]:
        return list(self.claims)

    def get(self, peer: str) -> Claim | None:
        return next((c for c in self.claims if c.peer == peer), None)


def planner(claims: list[Claim], *, rtts=None, verdicts=None, relayed=frozenset(), layers: int = 4,
            fixed_route=None) -> RoutePlanner:
    return RoutePlanner(FakeNode(relayed), layers, view=FakeView(claims), probes=FakeProbes(rtts, verdicts),
                        own_load=OwnLoad(), reputation=Reputation(), fixed_route=fixed_route, route_timeout=0.5)


def test_rtt_measured_guessed_slow_and_relayed():
    p = planner([], rtts={"a": 0.01, "r": 0.02}, verdicts={"s": "slow"}, relayed={"r"})
    assert p.rtt("a") == 0.01
    assert p.rtt("unknown") == UNKNOWN_RTT
    assert p.rtt("s") == SLOW_RTT
    assert p.rtt("r") == pytest.approx(0.02 * RELAYED_RTT_FACTOR)


def test_hop_cost_prefers_the_previous_hops_report_and_counts_compute_and_reputation():
    p = planner([], rtts={"b": 0.04})
    a = claim(peer="a", start=0, end=2, rtts=(("b", 0.01),))
    b = claim(peer="b", start=2, end=4, tput=100.0)
    assert p.hop_cost(None, b) == pytest.approx(0.04 / 2 + 1 / 100)  # our own round trip
    assert p.hop_cost(a, b) == pytest.approx(0.01 / 2 + 1 / 100)  # as the previous hop reported it
    p.reputation.note_report({"accused": "b", "reporter": "x", "layers": [2, 4], "divergence": 1.0})
    assert p.hop_cost(a, b) == pytest.approx((0.01 / 2 + 1 / 100) * 2.0)
    assert p.return_cost(b) == pytest.approx(0.02)
    assert p.route_cost([a, b]) == pytest.approx(p.hop_cost(None, a) + p.hop_cost(a, b) + p.return_cost(b))
    assert p.route_cost([]) == 0.0


async def test_usable_leaves_out_avoided_convicted_gone_and_forgotten_peers():
    claims = [claim(peer=x, start=0, end=4) for x in "abcde"]
    p = planner(claims, verdicts={"c": "gone"})
    p.reputation.convict("b", {})
    p.forget_peer("d")
    assert [c.peer for c in p.usable(claims, {"a"})] == ["e"]
    # a peer that claimed again since it failed is back
    newer = claim(peer="d", start=0, end=4, expires=claims[3].expires + 1)
    assert [c.peer for c in p.usable([newer], frozenset())] == ["d"]
    # and so is one whose time out is over
    p.forget_peer("e", seconds=0.01)
    await trio.sleep(0.02)
    assert [c.peer for c in p.usable(claims[4:], frozenset())] == ["e"]


async def test_find_route_picks_the_cheapest_chain_and_probes_its_peers():
    # (a and b claim twice the throughput per layer that "slow" does; never observed, they count
    # as the typical peer of their layers: what slow claims, see test_peer_speeds.py)
    claims = [claim(peer="slow", start=0, end=4, tput=250.0), claim(peer="a", start=0, end=2, tput=1000.0), claim(peer="b", start=2, end=4, tput=1000.0)]
    p = planner(claims, rtts={"slow": 0.005, "a": 0.001, "b": 0.001})
    route = await p.find_route()
    assert [c.peer for c in route] == ["a", "b"]
    assert p.probes.probed == [(["slow", "a", "b"], RTT_CACHE_S)]
    assert p.view.lookups == 1
    # healing: a kept peer looks cheaper (KEEP_DISCOUNT), so only the failed span changes
    p2 = planner(claims, rtts={"slow": 0.005, "a": 0.001, "b": 0.001})
    assert KEEP_DISCOUNT < 1
    assert [c.peer for c in await p2.find_route(keep=[claims[0]])] == ["slow"]


async def test_find_route_names_the_missing_layers_after_its_timeout():
    p = planner([claim(peer="a", start=0, end=2)])
    with pytest.raises(NoRouteError) as e:
        await p.find_route(timeout=0)
    assert str(e.value).startswith("after 0 s:") and e.value.code == "no_route"
    with pytest.raises(NoRouteError):
        await p.find_route(timeout=0.5, avoid={"a"})


async def test_a_peer_taken_for_gone_is_probed_again_before_no_route_is_said():
    """A replica killed and restarted: its new claim can arrive before a probe of the dead
    process fails, so the only claim left for a span has a stale "gone" verdict. The planner
    probes it again rather than telling the request nobody serves the layers."""
    claims = [claim(peer="a", start=0, end=2), claim(peer="b", start=2, end=4)]
    p = planner(claims, verdicts={"a": "gone"})
    with pytest.raises(NoRouteError, match=r"1 peer\(s\) left out: a.*\[0:2\] could not be reached"):
        await p.find_route(timeout=0)  # still gone when probed again
    assert (["a"], GONE_RECHECK_S) in p.probes.probed
    p.probes.revived.add("a")
    assert [c.peer for c in await p.find_route(timeout=0)] == ["a", "b"]
    # avoided and convicted peers are not probed for this
    p2 = planner(claims, verdicts={"a": "gone"})
    p2.reputation.convict("a", {})
    with pytest.raises(NoRouteError):
        await p2.find_route(timeout=0)
    assert p2.probes.probed == []


async def test_a_fixed_route_is_used_as_is_until_one_of_its_peers_fails():
    fixed = [claim(peer="a", start=0, end=4)]
    p = planner([], fixed_route=fixed)
    assert await p.find_route() is fixed
    assert p.view.lookups == 0
    with pytest.raises(NoRouteError, match="a peer of the fixed route failed"):
        await p.find_route(avoid={"a"})


def test_span_policy_matches_dtype_and_quantization():
    from shardnet.inference.client.route_planner import SpanPolicy
    from shardnet.protocols.block_claim import Claim

    def c(dtype="bfloat16", quant="none"):
        return Claim(model="m", start=0, end=1, kv_tokens=1, tput=1.0, addrs=(), expires=4e9, peer="p",
                     dtype=dtype, quant=quant)

    bf16 = SpanPolicy(dtype="bfloat16")
    assert bf16.accepts(c()) and bf16.accepts(c(dtype="unknown")) and not bf16.accepts(c(dtype="float32"))
    assert "computes in float32, not bfloat16" in bf16.why_not(c(dtype="float32"))
    assert bf16.accepts(c(quant="int8"))  # allowed unless asked otherwise
    assert not SpanPolicy(quantized="refuse").accepts(c(quant="int4"))
    assert SpanPolicy(quantized="refuse").accepts(c())
    assert SpanPolicy(quantized="require").accepts(c(quant="int8"))
    assert not SpanPolicy(quantized="require").accepts(c())


async def test_observed_steps_mark_an_overclaiming_peer_and_routes_avoid_it():
    claims = [claim(peer="a", start=0, end=2, tput=250.0), claim(peer="b", start=2, end=4, tput=250.0), claim(peer="c", start=2, end=4, tput=250.0),
              claim(peer="liar", start=2, end=4, tput=1e5)]
    p = planner(claims, rtts={x: 0.002 for x in ("a", "b", "c", "liar")})
    a, b, _, liar = claims
    # the liar, never observed, counts as the typical peer of its layers: a tie with b and c
    assert p.costs().compute(liar) == pytest.approx(1 / 250)
    # one token through a -> liar took as long as through a -> b: the liar is no faster than b
    for route in ([a, liar], [a, b]):
        p.observe_step(route, 1.2 * (0.003 + 2 / 250))
    assert p.reputation.overclaimers() == {"liar"}
    assert p.reputation.to_json()["liar"]["overclaim"] > 3
    for _ in range(20):
        assert "liar" not in {c.peer for c in await p.find_route()}


async def test_a_heal_goes_through_a_peer_blamed_only_as_slow_when_no_chain_avoids_it(monkeypatch):
    """A peer that answered no probe in time (busy, not gone) is routed around while another
    chain exists; where none does (it is its span's only peer), the heal goes through it again
    after a short wait, instead of failing the request after the route timeout. A peer that
    failed otherwise (named by its chain) stays avoided."""
    from shardnet.inference.client import healing
    from shardnet.inference.client.heal_plan import plan_heal

    monkeypatch.setattr(healing, "SLOW_ROUTE_AROUND_S", 0.05)
    a, b = claim(peer="a", start=0, end=4), claim(peer="b", start=0, end=4)

    def session(claims):
        p = planner(claims)
        node = SimpleNamespace(peer_id="me")
        return p, healing.HealingSession(SimpleNamespace(planner=p, node=node), max_len=16)

    p, sess = session([a, b])  # another replica: the heal takes it
    sess._only_slow.add("a")
    p.forget_peer("a", healing.SLOW_AVOID_S)
    assert [c.peer for c in await sess._route_round(plan_heal([a], ["a"]), ["a"])] == ["b"]
    p, sess = session([a])  # the span's only peer: through it again
    sess._only_slow.add("a")
    p.forget_peer("a", healing.SLOW_AVOID_S)
    assert [c.peer for c in await sess._route_round(plan_heal([a], ["a"]), ["a"])] == ["a"]
    p, sess = session([a])  # named as failed: no chain
    p.forget_peer("a")
    with pytest.raises(NoRouteError):
        await sess._route_round(plan_heal([a], ["a"]), ["a"])
    p, sess = session([a])  # slow once, later named by its chain: no longer only slow
    sess._only_slow.add("a")
    sess.inner = None
    assert await sess._name_failed(healing.InferenceError(healing.ErrorCode.NEXT_HOP, "x", "a")) == ["a"]
    p.forget_peer("a")
    with pytest.raises(NoRouteError):
        await sess._route_round(plan_heal([a], ["a"]), ["a"])
    p, sess = session([a, claim(peer="c", start=4, end=8)])  # only one of the two blamed was slow
    sess._only_slow.add("a")
    p.forget_peer("a", healing.SLOW_AVOID_S)
    p.forget_peer("c")
    with pytest.raises(NoRouteError):
        await sess._route_round(plan_heal([a], ["a", "c"]), ["a", "c"])
