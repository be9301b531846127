"""The simulated traffic: requests that arrive at gateways, are routed through the swarm's
claims, open sessions within the peers' KV budgets, decode, and heal around departed peers.

Routes are ``routing.plan_route`` with ``routing.ChainCost`` over the swarm's real ``Claim``
objects, as the gateway's client measures and weighs them; healing is
``heal_plan.plan_heal``, the decision ``HealingSession`` takes, then a route as
``find_route(avoid=..., keep=...)`` finds it; the KV budget, queue and step timeouts are the
client's and server's.

What is modelled, coarsely and on purpose (docs/scale.md says what that leaves out):

- A peer's decode step costs ``ModelSpec.step_seconds`` (a roofline) at its current batch; a
  request's tokens/s is 1 / (its chain's round trips plus every hop's step), recomputed every
  ``TICK_S``. A hop's batch is the number of sessions through it, so ``sum(rate) <= capacity``
  holds at every peer by construction.
- Requests arrive at gateways as a Poisson process in *cohorts*: ``cohort`` sessions that arrive
  together at one gateway, choose the same chain (as they would: one process, one view, one set
  of probes) and occupy ``cohort`` sessions of KV cache on each hop. A cohort of 1 is exact; more
  keeps 10,000-peer runs to minutes.
- Departures: a peer that closes its connections is noticed at once; one that vanishes only when
  keepalive closes the connection to it (``keepalive_interval`` + ``keepalive_timeout`` at
  most; ``STEP_TIMEOUT`` is the last resort, never reached here). Gateways' views drop a departed peer's claim when a
  request fails on it, or when a probe finds it gone (within ``RTT_CACHE_S``).
- Gateways' views follow every layer range's topic (``Swarm.visible``): they hold the news they
  heard and the claims their lookups of every layer range got (every ``claims_view.REFRESH_S``,
  and when a request finds no route).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import statistics
import time as wallclock
from dataclasses import dataclass, field

from bench.swarm_sim import wire, world
from bench.swarm_sim.events import TICK_S, EventLoop
from bench.swarm_sim.models import ModelSpec
from bench.swarm_sim.stats import Stats
from bench.swarm_sim.swarm import Peer, Swarm, layer_capacity
from shardnet.errors import NoRouteError
from shardnet.inference.claims_view import LOOKUP_GAP_S
from shardnet.inference.claims_view import REFRESH_S as VIEW_REFRESH_S
from shardnet.inference.client.heal_plan import plan_heal
from shardnet.inference.client.own_load import OwnLoad
from shardnet.inference.client.route_planner import RTT_CACHE_S
from shardnet.inference.client.routing import (
    ChainCost,
    link_rtt,
    plan_route,
    probe_order,
)
from shardnet.inference.client.timing import (
    NAMED_ERROR_WAIT,
    PROBE_TIMEOUT,
    QUEUE_TIMEOUT,
)
from shardnet.protocols.block_claim import Claim
from shardnet.transport.config import NodeConfig

KEEPALIVE = NodeConfig()
#: a typical round trip between peers when sizing the request load (the simulation measures
#: the real ones)
REF_RTT_S = 0.06
#: the batch a peer is assumed to run when sizing the request load
REF_BATCH = 16
#: ``RoutePlanner.measure_rtts`` probes at most this many peers per route
PROBES_PER_ROUTE = 64


@dataclass(eq=False)
class Request:
    id: int
    gateway: Gateway
    cohort: int
    prompt: int
    output: int
    arrived: float
    route: list[Claim] | None = None
    kv_each: list[int] = field(default_factory=list)
    open: bool = False
    generated: float = 0.0
    stalled_until: float = 0.0
    waiting_since: float | None = None
    first_token: float | None = None
    rate: float = 0.0
    rerouted_at: float = -1.0
    over: bool = False  # finished or failed


@dataclass(eq=False)
class Gateway:
    name: str
    city: world.City
    #: peer -> measured round trip (the client's Probes); kept until measured again
    rtts: dict[str, float] = field(default_factory=dict)
    probed_at: dict[str, float] = field(default_factory=dict)
    #: departed peers this gateway knows of
    known_gone: set[str] = field(default_factory=set)
    #: KV tokens this gateway's open sessions hold per peer (the client's OwnLoad)
    own: OwnLoad = field(default_factory=OwnLoad)
    #: peer -> expiry of the claim this gateway's view got from it by a lookup (its ClaimsView
    #: also follows every range's topic: ``Swarm.visible``)
    looked_up: dict[str, float] = field(default_factory=dict)
    last_lookup: float = -math.inf


class Traffic:
    """The requests through ``swarm`` on ``clock``. ``requests_rng`` draws the requests (when,
    where, how long), ``rng`` the decisions of the code under test (shared with the swarm)."""

    def __init__(self, *, model: ModelSpec, swarm: Swarm, clock: EventLoop, stats: Stats,
                 requests_rng: random.Random, rng: random.Random, warmup_s: float, load: float = 0.5,
                 cohort: int | None = None, cohorts_per_s: float = 4.0, probe_order: str = "stalest",
                 route_by_load: bool = True, suffix_entry: bool = False, reroute_busy: bool = False) -> None:
        self.model, self.swarm, self.clock, self.stats = model, swarm, clock, stats
        self.requests_rng, self.rng = requests_rng, rng
        self.warmup_s = warmup_s
        self.probe_order = probe_order
        #: routing weighs peers' load (``ChainCost``: the claim's, or this gateway's own sessions'
        #: share of the peer's KV budget if more, ``OwnLoad``), as it does now
        self.route_by_load = route_by_load
        #: what if a chain could enter a peer's span at any layer (shardnet cannot yet: a hop
        #: serves exactly its claimed span), leaving at its end
        self.suffix_entry = suffix_entry
        #: what if a request refused for want of KV room routed around the full peers instead
        #: of waiting for the same chain (``open_session`` waits; the simulation says waiting
        #: is better under overload: a re-routed request takes a slower chain, holds its KV
        #: cache longer, and more requests fail)
        self.reroute_busy = reroute_busy
        self._ids = itertools.count()
        self.requests: list[Request] = []
        self.gateways = [Gateway(n, world.city(n)) for n in world.GATEWAY_CITIES]
        swarm.gateway_followers = len(self.gateways)
        self._rtt_cache: dict[tuple[str, str], float] = {}
        swarm.on_leave = self.peer_left
        # each gateway's claims view looks every layer range up every claims_view.REFRESH_S (and
        # when a request finds no route), the gateways a share of that apart
        for i, g in enumerate(self.gateways):
            self.clock.at(VIEW_REFRESH_S * i / len(self.gateways), lambda g=g: self.view_lookup(g))
        # The request load: ``load`` times the sessions the swarm's KV caches can hold at once
        # (sessions of the median context), arriving at the rate that keeps that many open if
        # each decodes at ``estimated_rate``; in cohorts no larger than a chain's KV cache takes.
        # Sized on a sample of the world's peers (drawn as joiners are, never joined).
        peers = swarm.target_peers
        sample = [swarm.new_peer(0.0) for _ in range(min(peers, 400))]
        sample = [p for p in sample if p.n_layers > 0]
        ctx = world.PROMPT_MEDIAN + world.OUTPUT_MEDIAN
        per_peer = statistics.fmean(p.kv_bytes / (model.kv_bytes_per_token * ctx) for p in sample)
        self.session_capacity = per_peer * peers / model.num_layers
        self.bound_estimate = statistics.fmean(layer_capacity(p) for p in sample) * peers / model.num_layers
        concurrent = load * self.session_capacity
        self.rate_estimate = estimated_rate(model, sample)
        sessions_per_s = concurrent / (world.mean_output() / self.rate_estimate)
        self.offered = sessions_per_s * world.mean_output()
        fits = min(p.kv_bytes / (model.kv_bytes_per_token * p.n_layers * ctx) for p in sample)
        self.cohort = cohort or int(max(1, min(fits / 2, sessions_per_s / cohorts_per_s)))
        self.arrival_rate = sessions_per_s / self.cohort  # cohorts per second

    @property
    def now(self) -> float:
        return self.clock.now

    def view_lookup(self, g: Gateway) -> None:
        self.look_up(g)
        self.clock.later(VIEW_REFRESH_S, lambda: self.view_lookup(g))

    def look_up(self, g: Gateway) -> None:
        g.last_lookup = self.now
        self.swarm.look_up_into(g.looked_up)

    def kick(self, g: Gateway) -> None:
        """A request found no route: the view looks up (``ClaimsView.kick``), at most once per
        ``LOOKUP_GAP_S``; the request has failed meanwhile."""
        if self.now - g.last_lookup >= LOOKUP_GAP_S:
            self.look_up(g)

    def gateway_rtt(self, g: Gateway, p: Peer) -> float:
        key = (g.name, p.id)
        r = self._rtt_cache.get(key)
        if r is None:
            r = self._rtt_cache[key] = world.path_rtt(g.city, p.city) + 2 * (p.access + world.DC_ACCESS_S[1])
        return r

    # -- requests --------------------------------------------------------------------------------
    def tick(self, dt: float) -> None:
        """``dt`` simulated seconds: new requests arrive and are routed, waiting ones try to open,
        open ones decode; the finished are done."""
        n = _poisson(self.requests_rng, self.arrival_rate * dt)
        for _ in range(n):
            g = self.requests_rng.choice(self.gateways)
            prompt, output = world.prompt_and_output(self.requests_rng)
            r = Request(next(self._ids), g, self.cohort, prompt, output, self.now)
            self.requests.append(r)
            self.route(r)
        done = []
        for r in list(self.requests):
            if r.over:
                continue  # failed meanwhile
            if r.waiting_since is not None:
                self.try_open(r)
            if r.over or not r.open or self.now < r.stalled_until:
                continue
            r.rate = self.rate(r)
            r.generated += r.rate * dt
            if self.now >= self.warmup_s:
                self.stats.tokens += r.rate * dt * r.cohort
            if r.generated >= r.output:
                done.append(r)
        for r in done:
            self.finish(r)
        self.requests = [r for r in self.requests if not r.over]

    def usable(self, g: Gateway, avoid: set[str] | frozenset[str]) -> list[Claim]:
        visible = self.swarm.visible
        return [c for c in self.swarm.claims.values()
                if c.peer not in g.known_gone and c.peer not in avoid and visible(c.peer, g.looked_up)]

    def route(self, r: Request, *, avoid: set[str] | frozenset[str] = frozenset(), keep: list[Claim] | None = None,
              or_wait: bool = False) -> bool:
        """Choose ``r``'s chain and try to open it. ``or_wait``: when no chain avoids ``avoid``,
        keep the chain it has (False returned) instead of failing."""
        g = r.gateway
        usable = self.usable(g, avoid)
        self.probe(g, [c.peer for c in usable])
        if self.suffix_entry:
            usable = usable + [dataclasses.replace(c, start=b, tput=c.tput * (c.end - c.start) / (c.end - b))
                               for c in usable if c.serving for b in range(c.start + 1, c.end)]
        peers = self.swarm.peers

        def rtt(peer: str) -> float:
            q = peers.get(peer)
            return link_rtt(g.rtts.get(peer), relayed=False) if q is not None else link_rtt(None)

        t0 = wallclock.perf_counter()
        try:
            route = plan_route(usable, self.model.num_layers,
                               cost=ChainCost(rtt, kept=frozenset(c.peer for c in keep or ()),
                                              load=g.own.load if self.route_by_load else _no_load),
                               rng=self.rng)
        except NoRouteError:
            self.kick(g)
            if not or_wait:
                self.fail(r, "no route")
            return False
        finally:
            self.stats.route_ms.append(1000 * (wallclock.perf_counter() - t0))
        r.route = route
        r.waiting_since = self.now
        self.try_open(r)
        return True

    def probe(self, g: Gateway, peers: list[str]) -> None:
        """``RoutePlanner.measure_rtts``: probe up to PROBES_PER_ROUTE peers not probed within
        RTT_CACHE_S, in ``routing.probe_order`` (``stalest``, what shardnet does) or the first
        ones in the view's order (``first``, what it did before this simulator showed why not)."""
        if self.probe_order == "first":
            chosen = peers[:PROBES_PER_ROUTE]
        else:
            chosen = probe_order(peers, g.probed_at, PROBES_PER_ROUTE)
        for peer in chosen:
            if self.now - g.probed_at.get(peer, -1e9) < RTT_CACHE_S:
                continue
            q = self.swarm.peers.get(peer)
            g.probed_at[peer] = self.now
            self.swarm.count("ping", 1, wire.PING)
            if q is None:
                g.known_gone.add(peer)
            else:
                g.rtts[peer] = self.gateway_rtt(g, q)

    def try_open(self, r: Request) -> None:
        """Open the chain's sessions when every hop has KV room; else wait in line (the client
        retries the same chain) until QUEUE_TIMEOUT."""
        hops = [self.swarm.peers.get(c.peer) for c in r.route]
        if any(q is None for q in hops):
            self.heal(r, next(c.peer for c, q in zip(r.route, hops) if q is None))
            return
        need = [r.cohort * (r.prompt + r.output) * self.model.kv_bytes_per_token * (c.end - c.start)
                for c in r.route]
        if all(q.kv_used + n <= q.kv_bytes for q, n in zip(hops, need)):
            for q, n, c in zip(hops, need, r.route):
                q.kv_used += n
                q.sessions += r.cohort
                q.open_spans[(c.start, c.end)] += r.cohort
                r.gateway.own.tokens[c.peer] += r.cohort * (r.prompt + r.output)
                self.swarm.load_changed(q)
            r.kv_each, r.open = need, True
            wait = self.now - r.waiting_since
            r.waiting_since = None
            prefill = self.chain_rtt(r) + sum(q.model.prefill_seconds(q.gpu, c.start, c.end, r.prompt + int(r.generated))
                                              for q, c in zip(hops, r.route))
            r.stalled_until = self.now + prefill
            if r.first_token is None:
                r.first_token = self.now + prefill
                if self.now >= self.warmup_s:
                    self.stats.ttft.append(wait + prefill)
        elif self.now - r.waiting_since >= QUEUE_TIMEOUT:
            self.fail(r, "busy")
        elif self.reroute_busy and r.rerouted_at != self.now:
            r.rerouted_at = self.now
            full = {q.id for q, n in zip(hops, need) if q.kv_used + n > q.kv_bytes}
            since = r.waiting_since
            plan = plan_heal(r.route, full)  # around the full peers, as around failed ones
            if self.route(r, avoid=plan.avoid, keep=plan.keep, or_wait=True):
                r.waiting_since = since  # the line it waits in is the same request's

    def chain_rtt(self, r: Request) -> float:
        total, prev = 0.0, None
        for c in r.route:
            q = self.swarm.peers[c.peer]
            total += (self.gateway_rtt(r.gateway, q) if prev is None else self.swarm.rtt(prev, q)) / 2
            prev = q
        return total + self.gateway_rtt(r.gateway, prev) / 2

    def rate(self, r: Request) -> float:
        peers = self.swarm.peers
        step = sum(peers[c.peer].step(peers[c.peer].sessions) for c in r.route)
        return 1.0 / (self.chain_rtt(r) + step)

    def release(self, r: Request) -> None:
        if r.open:
            for c, n in zip(r.route, r.kv_each):
                q = self.swarm.peers.get(c.peer)
                if q is not None:
                    q.kv_used -= n
                    q.sessions -= r.cohort
                    q.open_spans[(c.start, c.end)] -= r.cohort
                    if q.open_spans[(c.start, c.end)] <= 0:
                        del q.open_spans[(c.start, c.end)]
                    self.swarm.load_changed(q)
                own = r.gateway.own.tokens
                own[c.peer] -= r.cohort * (r.prompt + r.output)
                if own[c.peer] <= 0:
                    del own[c.peer]
        r.open = False

    def finish(self, r: Request) -> None:
        self.release(r)
        r.over = True
        if r.arrived >= self.warmup_s:
            self.stats.completed += r.cohort
            decode = self.now - (r.first_token or self.now)
            self.stats.request_rates.append((r.output / max(decode, TICK_S / 2), r.cohort))

    def fail(self, r: Request, why: str) -> None:
        self.release(r)
        r.route = None
        r.waiting_since = None
        r.over = True
        if r.arrived >= self.warmup_s:
            self.stats.failed[why] += r.cohort

    # -- departures and healing ------------------------------------------------------------------
    def peer_left(self, p: Peer) -> None:
        """``p`` left the swarm: the requests through it heal; each gateway's view drops its
        claim within ``RTT_CACHE_S`` (a probe finds it gone)."""
        for r in list(self.requests):
            if r.route and any(c.peer == p.id for c in r.route):
                self.fail_hop(r, p)
        for g in self.gateways:
            self.clock.later(self.rng.uniform(0, RTT_CACHE_S), lambda g=g: g.known_gone.add(p.id))

    def fail_hop(self, r: Request, p: Peer) -> None:
        """A peer of ``r``'s chain left: the client notices (at once when the peer closed its
        connections, when keepalive gives up on it when it vanished), names it, and heals."""
        was_open = r.open
        self.release(r)
        if not was_open:
            return  # a request waiting in line finds the peer gone when it tries again
        if p.graceful:
            notice = 2 * NAMED_ERROR_WAIT + PROBE_TIMEOUT
        else:  # the previous hop's keepalive closes the dead connection, and says so
            notice = self.rng.uniform(KEEPALIVE.keepalive_timeout,
                                      KEEPALIVE.keepalive_interval + KEEPALIVE.keepalive_timeout) + NAMED_ERROR_WAIT
        r.stalled_until = self.now + notice
        started = self.now

        def heal() -> None:
            if not r.over and self.heal(r, p.id) and r.open:
                self.stats.heal_seconds.append(r.stalled_until - started)

        self.clock.at(self.now + notice, heal)

    def heal(self, r: Request, failed: str) -> bool:
        """Route ``r`` around the peer that failed as ``HealingSession`` does (``plan_heal``:
        avoid it, keep the rest of the chain); the gateway knows that peer gone now."""
        r.gateway.known_gone.add(failed)
        if r.arrived >= self.warmup_s:
            self.stats.heals += r.cohort
        plan = plan_heal(r.route or [], [failed])
        return self.route(r, avoid=plan.avoid, keep=plan.keep)


def _no_load(claim: Claim) -> float:
    return 0.0  # routes blind to load, as before (shardnet-before)


def estimated_rate(model: ModelSpec, peers: list[Peer]) -> float:
    """Tokens/s of one session through a typical chain: as many hops as the model's layers over
    the peers' mean span, each a REF_RTT_S round trip and a step at REF_BATCH."""
    mean_layers = statistics.fmean(p.n_layers for p in peers)
    hops = model.num_layers / mean_layers
    step = statistics.fmean(model.step_seconds(p.gpu, 0, p.n_layers, REF_BATCH) / p.n_layers for p in peers)
    return 1.0 / (hops * REF_RTT_S + model.num_layers * step)


def _poisson(rng: random.Random, lam: float) -> int:
    if lam > 50:
        return max(0, int(round(rng.gauss(lam, math.sqrt(lam)))))
    n, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1
