"""Route planning: which peers a client routes through, and what each hop costs.

The planner holds the client's view of the swarm's claims (``ClaimsView``), the node's round-trip
probes and what the node's own sessions hold at each peer (``OwnLoad``), all three shared by the
node's clients and handed over by the ``Client``. It knows which peers failed during a request
(``forget_peer``) and which the client's reputation excludes, and picks the cheapest chain with
``routing.plan_route``. A claim's throughput counts as far as this client's observations of its
steps bear it out (``PeerSpeeds``, peer_speeds.py; ``observe_step``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from shardnet.errors import NoRouteError, ShardnetError
from shardnet.inference.claims import CLAIM_TTL, RTT_SAMPLES
from shardnet.inference.client.peer_speeds import PeerSpeeds, typical_tput
from shardnet.inference.client.reputation import Reputation
from shardnet.inference.client.routing import (
    UNKNOWN_RTT,
    ChainCost,
    link_rtt,
    plan_route,
    probe_order,
)
from shardnet.protocols.block_claim import Claim

if TYPE_CHECKING:
    from shardnet.inference.claims_view import ClaimsView
    from shardnet.inference.client.own_load import OwnLoad
    from shardnet.inference.probes import Probes
    from shardnet.transport.node import Node

log = logging.getLogger(__name__)


RTT_CACHE_S = 30.0
#: a "gone" verdict older than this is probed again before a request is told no peer serves a
#: layer (a peer killed and restarted claims anew, but its new claim can reach this node before
#: a probe of the dead process finishes)
GONE_RECHECK_S = 3.0
GONE = "could not be reached when probed"


@dataclass(frozen=True)
class SpanPolicy:
    """Which peers' spans a client routes through: those computing in its dtype (peers whose
    claim does not say are taken), quantized or not as the user asked."""

    dtype: str | None = None
    #: "allow" quantized spans, "require" them, or "refuse" them
    quantized: str = "allow"

    def accepts(self, c: Claim) -> bool:
        if self.dtype and c.dtype not in (self.dtype, "unknown"):
            return False
        if self.quantized == "allow":
            return True
        return (c.quant != "none") == (self.quantized == "require")

    def why_not(self, c: Claim) -> str:
        if self.dtype and c.dtype not in (self.dtype, "unknown"):
            return f"computes in {c.dtype}, not {self.dtype}"
        return f"is {'not ' if c.quant == 'none' else ''}quantized ({c.quant}; --quantized {self.quantized})"


#: seconds a client routes around a peer that failed in a request (unless it claims anew): after
#: that its claim, if still held, is probed again like any other
FORGET_S = 600.0


class RoutePlanner:
    """Chains over ``num_layers`` layers through the peers in ``view``. ``fixed_route``: always
    this chain (no lookups), unless one of its peers is to be avoided."""

    def __init__(self, node: Node, num_layers: int, *, view: ClaimsView, probes: Probes, own_load: OwnLoad,
                 reputation: Reputation, fixed_route: list[Claim] | None = None,
                 route_timeout: float = 30.0, policy: SpanPolicy = SpanPolicy()) -> None:
        self.node, self.num_layers = node, num_layers
        self.policy = policy
        #: the swarm's claims for the model (shared by every client of the node)
        self.view = view
        #: round-trip probes (shared likewise)
        self.probes = probes
        self.reputation = reputation
        self.fixed_route = fixed_route
        self.route_timeout = route_timeout
        #: KV this node's open sessions hold at each peer (shared by the node's clients)
        self.own_load = own_load
        #: how fast this client saw its peers compute, against their claims (this client's own)
        self.speeds = PeerSpeeds()
        #: each layer's typical claimed throughput among the claims of the last route chosen
        self._typical: Callable[[Claim], float] | None = None
        #: peer -> (until (trio time), the expiry of its claim then): failed during a request
        self._avoid: dict[str, tuple[float, float]] = {}

    def forget_peer(self, peer: str, seconds: float = FORGET_S) -> None:
        """Route around ``peer`` for a while (its claim may outlive it in the DHT), or until it
        signs a newer claim: a peer that restarted and claimed its layers again is back."""
        claim = self.view.get(peer)
        self._avoid[peer] = (trio.current_time() + seconds, claim.expires if claim else time.time() + CLAIM_TTL)

    def pardon(self, peer: str) -> None:
        """Route through ``peer`` again (``forget_peer`` undone)."""
        self._avoid.pop(peer, None)

    async def find_route(self, *, timeout: float | None = None, avoid: set[str] | frozenset = frozenset(),
                         keep: list[Claim] | None = None) -> list[Claim]:
        """The cheapest chain covering every layer (see ``routing``); waits up to ``timeout`` for
        peers to appear, then raises NoRouteError naming the layers nobody serves. ``keep``:
        claims of a chain being healed, preferred so that only failed spans change."""
        if self.fixed_route:
            if not (avoid & {c.peer for c in self.fixed_route}):
                return self.fixed_route
            raise NoRouteError("a peer of the fixed route failed: "
                               + ", ".join(c.peer[:16] for c in self.fixed_route if c.peer in avoid))
        timeout = self.route_timeout if timeout is None else timeout
        deadline = trio.current_time() + timeout
        kept = {c.peer for c in keep or ()}
        last_error: Exception | None = None
        view = self.view
        view.start()
        if view.running and not view.first_lookup.is_set():
            # A new view fills from gossip claim by claim: the first route is chosen from what a
            # whole lookup sees, not from whichever claims happened to arrive first.
            with trio.move_on_after(max(0.0, deadline - trio.current_time())):
                await view.first_lookup.wait()
        while True:
            if not view.running:  # a node without a nursery of its own: look up here
                await view.lookup(timeout=max(1.0, min(15.0, deadline - trio.current_time())))
            claims = view.current()
            try:
                return await self._cheapest(claims, avoid, kept)
            except NoRouteError as e:
                last_error = e
            left = deadline - trio.current_time()
            if left <= 0:
                why = f"; {view.last_lookup_error}" if view.last_lookup_error and not claims else ""
                if not claims:
                    why += await self._what_the_swarm_serves()
                raise NoRouteError(f"after {timeout:g} s: {last_error}{why}")
            # a fresh lookup (one for every request waiting, at most one per LOOKUP_GAP_S), and
            # whatever gossip brings meanwhile
            view.kick()
            if view.running:
                await view.wait_changed(min(1.0, left))
            else:
                await trio.sleep(min(1.0, left))

    async def _what_the_swarm_serves(self) -> str:
        """For a client whose model nobody serves: the models the swarm does serve (their cards)."""
        from shardnet.inference.weights.cards import list_models

        try:
            served = [m for m in await list_models(self.node, timeout=5.0) if m.card.model_id != self.view.model_id]
        except ShardnetError:
            return ""
        if not served:
            return ""
        listing = "; ".join(f"{(m.card.names or ('?',))[0]} ({m.card.model_id[:16]}…, {m.peers} peers)"
                            for m in served[:5])
        return f"; no peer serves model {self.view.model_id[:16]}…, the swarm serves: {listing}"

    async def _cheapest(self, claims: list[Claim], avoid, kept: set[str]) -> list[Claim]:
        """The cheapest chain through ``claims`` now, after probing their peers; NoRouteError if
        the usable ones do not cover every layer."""
        usable = self.usable(claims, avoid)
        try:
            # fail fast, before measuring anything (every round trip a guess)
            plan_route(usable, self.num_layers, cost=ChainCost(lambda peer: UNKNOWN_RTT), sub_spans=True)
        except NoRouteError as e:
            if await self._recheck_gone(claims, avoid):
                return await self._cheapest(claims, avoid, kept)
            excluded, now = self.reputation.excluded(), trio.current_time()
            left_out = [(c, why) for c in claims if (why := self.why_left_out(c, avoid, excluded, now))]
            if left_out:
                listed = "; ".join(f"{c.peer[:12]}…[{c.start}:{c.end}] {why}" for c, why in left_out[:3])
                more = f"; {len(left_out) - 3} more" if len(left_out) > 3 else ""
                raise NoRouteError(f"{e} ({len(left_out)} peer(s) left out: {listed}{more})") from None
            raise
        await self.measure_rtts([c.peer for c in usable])
        usable = self.usable(claims, avoid)  # without the peers found gone

        costs = self.costs(kept, usable)
        route = plan_route(usable, self.num_layers, cost=costs, sub_spans=True)
        log.info("route: %s (estimated %.1f ms per token)",
                 " -> ".join(f"{c.peer[:12]}…[{c.start}:{c.end}]" for c in route), 1000 * costs.total(route))
        return route

    async def _recheck_gone(self, claims: list[Claim], avoid) -> bool:
        """Probe again the peers left out only for a "gone" verdict older than GONE_RECHECK_S;
        True if one of them answered (a route may exist after all)."""
        excluded, now = self.reputation.excluded(), trio.current_time()
        doubted = [c.peer for c in claims if self.why_left_out(c, avoid, excluded, now) == GONE]
        if not doubted:
            return False
        found = await self.probes.probe(doubted, max_age=GONE_RECHECK_S, timeout=2.0, samples=1)
        back = [p for p, probe in found.items() if probe.verdict != "gone"]
        if back:
            log.info("peers taken for gone answer again: %s", ", ".join(p[:12] for p in back))
        return bool(back)

    async def usable_claims(self) -> list[Claim]:
        """Claims of peers this client would route through now."""
        self.view.start()
        if not self.view.running:
            await self.view.lookup(timeout=5.0)
        elif not self.view.lookups:
            await self.view.wait_changed(5.0)
        return self.usable(self.view.current(), frozenset())

    def usable(self, claims: list[Claim], avoid) -> list[Claim]:
        """``claims`` less those of peers avoided, excluded by reputation, gone, or failed during
        a request and not claimed again since."""
        excluded = self.reputation.excluded()
        now = trio.current_time()
        return [c for c in claims if self.why_left_out(c, avoid, excluded, now) is None]

    def why_left_out(self, c: Claim, avoid, excluded: set[str], now: float) -> str | None:
        """Why ``c`` is not routed through now (None: it is)."""
        if c.peer in avoid:
            return "failed in this request"
        if c.peer in excluded:
            return "convicted of wrong results"
        if not self.policy.accepts(c):
            return self.policy.why_not(c)
        until, expiry_then = self._avoid.get(c.peer, (0.0, 0.0))
        if until > now and c.expires <= expiry_then:
            return "failed during a request and has not claimed again since"
        if self.probes.verdict(c.peer) == "gone":
            return GONE
        return None

    def rtt(self, peer: str) -> float:
        """Our round trip to ``peer`` (measured, else a guess), relayed links counted several times."""
        return link_rtt(self.probes.rtts.get(peer), slow=self.probes.verdict(peer) == "slow",
                        relayed=self.node.link(peer) == "relayed")

    def costs(self, kept: set[str] | frozenset = frozenset(), claims: list[Claim] | None = None) -> ChainCost:
        """What a chain costs as this client sees it now (see ``routing.ChainCost``); ``claims``:
        those it is chosen among, which set each layer's typical throughput (default: those the
        last route was chosen among, else the view's)."""
        tput = self.speeds.routing_tput(self._typical_tput(claims))
        return ChainCost(self.rtt, self.reputation.cost_factor, frozenset(kept), load=self.own_load.load, tput=tput)

    def _typical_tput(self, claims: list[Claim] | None = None) -> Callable[[Claim], float]:
        if claims is not None or self._typical is None:
            self._typical = typical_tput(self.view.current() if claims is None else claims)
        return self._typical

    def observe_step(self, route: list[Claim], seconds: float) -> None:
        """One decoded token's step through ``route`` took ``seconds`` (sent to result back, alone
        in flight): noted against its peers' claims, and their standing updated. (Per token: it
        reads no claims, only those of the last route chosen.)"""
        self.speeds.observe(route, seconds, ChainCost(self.rtt).transport(route), self._typical_tput())
        overclaims = self.speeds.overclaims()
        for peer in set(overclaims) | self.reputation.overclaimers():  # (forgotten ones too)
            self.reputation.overclaiming(peer, overclaims.get(peer))

    def hop_cost(self, prev: Claim | None, claim: Claim) -> float:
        return self.costs().hop(prev, claim)

    def return_cost(self, last: Claim) -> float:
        return self.costs().finish(last)

    def route_cost(self, route: list[Claim]) -> float:
        return self.costs().total(route)

    async def measure_rtts(self, peers: list[str], *, timeout: float = 2.0, most: int = 64) -> None:
        """Probe the peers not probed lately (shared with every other request; see probes.py). A
        peer that cannot be reached is left out of routes until it claims again or ``GONE_S``
        passes; one that is there but does not answer in time is a costly hop (``SLOW_RTT``)."""
        probed_at = {peer: p.at for peer, p in self.probes.results.items()}
        await self.probes.probe(probe_order(peers, probed_at, most), max_age=RTT_CACHE_S, timeout=timeout,
                                samples=RTT_SAMPLES)
