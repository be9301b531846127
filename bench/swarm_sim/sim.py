"""A discrete-event simulation of a shardnet swarm: peers that join, serve, move and leave, and
requests that gateways route through them and heal around departures.

No sockets and no torch: a simulated clock, and the project's own decisions called as the
network code calls them -- placement through ``policies`` (``shardnet`` is
``shardnet.inference.server.placement``), routes through ``routing.plan_route`` with
``routing.ChainCost`` over real ``Claim`` objects, healing as ``find_route(avoid=failed,
keep=chain)`` does it, the KV budget, queue and step timeouts of the client and server.

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
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
import statistics
import zlib
import time as wallclock
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.swarm_sim import world
from bench.swarm_sim.models import ModelSpec
from shardnet.errors import NoRouteError
from shardnet.inference.claims import CLAIM_TTL
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
from shardnet.inference.server.placement import (
    DEFAULT_REBALANCE_INTERVAL,
    MEMORY_USE,
    SETTLE_S,
    UPKEEP_JITTER,
    layers_fitting,
    upkeep_step,
)
from shardnet.protocols.block_claim import MAX_RTTS, Claim
from shardnet.transport.config import NodeConfig

TICK_S = 2.0
KEEPALIVE = NodeConfig()
#: the most tokens one forward pass of a peer's block scheduler takes (scheduler.DEFAULT_MAX_TOKENS,
#: not imported: that module needs torch); more sessions take more passes
BATCH_TOKENS = 256
#: a typical round trip between peers when sizing the request load (the simulation measures
#: the real ones)
REF_RTT_S = 0.06
#: the batch a peer is assumed to run when sizing the request load
REF_BATCH = 16
SAMPLE_S = 60.0
#: simulated seconds between two calls of ``Sim.run``'s progress callback
PROGRESS_S = 600.0
#: the claim publisher republishes every third of the TTL (claim_publisher.py)
REPUBLISH_S = CLAIM_TTL / 3
#: compute_peer.RECHECK_DELAY
RECHECK_DELAY = (0.5, 2.5)
#: ``RoutePlanner.measure_rtts`` probes at most this many peers per route
PROBES_PER_ROUTE = 64
#: Kademlia: py-libp2p's concurrency (kad_dht/common.py ALPHA) and replication (BUCKET_SIZE)
DHT_ALPHA, DHT_K = 10, 20
#: gossipsub mesh degree (transport/pubsub.py)
GOSSIP_D = 6
HUBS = ("Ashburn", "San Francisco", "Frankfurt", "London", "Singapore", "Tokyo", "Sao Paulo", "Mumbai", "Sydney")


@dataclass(eq=False)
class Peer:
    id: str
    gpu: world.Gpu
    city: world.City
    access: float  # one-way access latency (s)
    nat: bool  # behind a NAT that blocks inbound connections
    punch_ok: float  # this peer's share of successful hole punches with other NATed peers
    relay: world.City | None
    joined: float
    leaves_at: float
    graceful: bool
    downlink_mbs: float
    cached: bool
    n_layers: int
    model: ModelSpec
    kv_bytes: int
    span: tuple[int, int] | None = None  # the span it serves (claimed)
    target: tuple[int, int] | None = None  # the span it is loading or serves
    moving: bool = False
    settle_until: float = 0.0
    gone: bool = False
    sessions: int = 0
    kv_used: int = 0
    #: open sessions per span: after a move, sessions opened on the old span finish on it
    #: (the old block stays loaded until they do, as compute_peer does)
    open_spans: Counter = field(default_factory=Counter)
    rtts: tuple = ()
    since: float = 0.0
    _steps: dict = field(default_factory=dict)
    _tput: dict = field(default_factory=dict)

    @property
    def tput(self) -> float:
        return self.tput_at(*self.span) if self.span else 0.0

    def tput_at(self, start: int, end: int) -> float:
        key = (start, end)
        if key not in self._tput:
            self._tput[key] = 1.0 / self.model.step_seconds(self.gpu, start, end, 1)
        return self._tput[key]

    def step(self, batch: int) -> float:
        """Seconds per decode step of the current span at ``batch`` sessions: full passes of
        BATCH_TOKENS and one of the rest (cached; the rest rounded up)."""
        full, rest = divmod(max(1, batch), BATCH_TOKENS)
        if rest >= 16:
            rest = -(-rest // 8) * 8  # the step time is smooth in the batch: rounded up, never down
        return full * self._pass(BATCH_TOKENS) + (self._pass(rest) if rest else 0.0)

    def _pass(self, batch: int) -> float:
        t = self._steps.get(batch)
        if t is None:
            t = self._steps[batch] = self.model.step_seconds(self.gpu, *self.span, batch)
        return t

    def capacity(self) -> float:
        """Tokens/s the span gives at full batches: the most it can carry however requests are
        routed (no batch does better: see ``capacity_at``)."""
        return capacity_at(self, *self.span) if self.span else 0.0


def capacity_at(peer: Peer, start: int, end: int) -> float:
    """A span's tokens/s at full batches. batch / step(batch) grows with the batch (a step's
    time is its weight reads, concave in the batch, plus FLOPs linear in it) up to one full
    pass, and more passes only repeat it, so this bounds every batch."""
    return BATCH_TOKENS / peer.model.step_seconds(peer.gpu, start, end, BATCH_TOKENS)


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


@dataclass
class Stats:
    peers_hours: float = 0.0
    covered_s: float = 0.0
    observed_s: float = 0.0
    gaps: list[tuple[float, bool]] = field(default_factory=list)  # (seconds, spare capacity then)
    samples: list[dict] = field(default_factory=list)
    request_rates: list[tuple[float, int]] = field(default_factory=list)  # (tok/s, weight)
    ttft: list[float] = field(default_factory=list)
    completed: int = 0
    tokens: float = 0.0
    heals: int = 0
    heal_seconds: list[float] = field(default_factory=list)
    failed: Counter = field(default_factory=Counter)
    placed_s: list[float] = field(default_factory=list)
    moves: int = 0
    joins: int = 0
    leaves: int = 0
    msgs: Counter = field(default_factory=Counter)
    route_ms: list[float] = field(default_factory=list)
    uncovered_since: dict[int, tuple[float, bool]] = field(default_factory=dict)


class Policy:
    """A placement policy (bench/swarm_sim/policies.py): what the simulator asks of one."""

    name = "?"
    #: whether peers look the swarm up (DHT lookups, pings) to decide
    decentralized = True

    def choose(self, sim: Sim, peer: Peer) -> tuple[int, int]:
        raise NotImplementedError

    def upkeep(self, sim: Sim, peer: Peer) -> float | None:
        """Called at the peer's upkeep time; may start a move (``sim.move``). Returns the
        seconds until the next upkeep, or None for none."""
        return None

    def tick(self, sim: Sim) -> None:
        """Called once a simulated minute (a central scheduler's chance to act)."""


class Sim:
    def __init__(self, *, model: ModelSpec, policy: Policy, peers: int, hours: float, seed: int = 1,
                 load: float = 0.5, cohort: int | None = None, warmup_s: float = 600.0,
                 probe_order: str = "stalest", cohorts_per_s: float = 4.0, announce_loading: bool = True,
                 route_by_load: bool = True, suffix_entry: bool = False, reroute_busy: bool = False,
                 load_step: float | None = None) -> None:
        self.model, self.policy, self.target_peers = model, policy, peers
        # three streams, so that every policy meets the same world: the peers (who comes, when,
        # with what, for how long), the requests, and the decisions the code under test draws
        self.world_rng = random.Random(f"{seed}/peers")
        self.requests_rng = random.Random(f"{seed}/requests")
        self.rng = random.Random(f"{seed}/decisions")
        self.now = 0.0
        self.end = hours * 3600.0
        self.warmup_s = warmup_s
        self.probe_order = probe_order
        #: peers claim the span they are loading (``Claim.loading``), as shardnet peers do now
        self.announce_loading = announce_loading
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
        #: what if a peer republished its claim whenever its load crossed a multiple of this
        #: (None: only at its upkeep and every REPUBLISH_S, as shardnet does)
        self.load_step = load_step
        self.peers: dict[str, Peer] = {}
        self.claims: dict[str, Claim] = {}  # peers' claims, in the order they first claimed
        self.claim_ids = SampleSet()  # the same peers, to draw a lookup's providers from
        self.by_start: dict[int, dict[str, None]] = {}  # claims by first layer, in claim order
        self._planned = [0.0] * model.num_layers
        self._planned_by: dict[str, tuple[int, int, float]] = {}
        self.layer_count = [0] * model.num_layers
        self._events: list = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._peer_ids = itertools.count()
        self.requests: list[Request] = []
        self.gateways = [Gateway(n, world.city(n)) for n in world.GATEWAY_CITIES]
        self.stats = Stats()
        self._rtt_cache: dict[tuple[str, str], float] = {}
        self.mean_session = self._mean_session()
        # The request load: ``load`` times the sessions the swarm's KV caches can hold at once
        # (sessions of the median context), arriving at the rate that keeps that many open if
        # each decodes at ``estimated_rate``; in cohorts no larger than a chain's KV cache takes.
        sample = [self._new_peer(0.0) for _ in range(min(peers, 400))]
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

    # -- the world -------------------------------------------------------------------------------
    def _mean_session(self) -> float:
        dc = sum(g.share for g in world.GPUS if g.datacenter)
        home = 1 - dc
        g = math.gamma(1 + 1 / world.CHURN_SHAPE) / math.log(2) ** (1 / world.CHURN_SHAPE)
        return g * (home * world.HOME_MEDIAN_S + dc * world.DC_MEDIAN_S)

    def _new_peer(self, t: float) -> Peer:
        rng = self.world_rng
        gpu = world.pick(rng, world.GPUS)
        city = world.pick(rng, world.CITIES)
        dc = gpu.datacenter
        nat = (not dc) and rng.random() < world.HOME_NAT_SHARE
        session = world.weibull_with_median(rng, world.DC_MEDIAN_S if dc else world.HOME_MEDIAN_S)
        mem = int(gpu.memory_gib * 2**30)
        kv = int(mem * world.KV_SHARE)
        budget = int(mem * MEMORY_USE) - kv
        n = layers_fitting(self.model.layer_sizes(), budget)
        relay = min((world.city(h) for h in HUBS), key=lambda h: world.great_circle_km(h, city)) if nat else None
        return Peer(id=f"p{next(self._peer_ids)}", gpu=gpu, city=city,
                    access=rng.uniform(*(world.DC_ACCESS_S if dc else world.HOME_ACCESS_S)), nat=nat,
                    punch_ok=world.HOLE_PUNCH_SUCCESS, relay=relay, joined=t, leaves_at=t + session,
                    graceful=rng.random() < world.GRACEFUL_SHARE,
                    downlink_mbs=world.DC_DOWNLINK_MBS if dc else rng.uniform(*world.HOME_DOWNLINK_MBS),
                    cached=rng.random() < world.WEIGHTS_CACHED, n_layers=n, model=self.model, kv_bytes=kv)

    def relayed(self, a: Peer, b: Peer) -> bool:
        """Two NATed peers connect directly when a hole punch works (decided once per pair)."""
        if not (a.nat and b.nat):
            return False
        h = zlib.crc32(f"{min(a.id, b.id)}|{max(a.id, b.id)}".encode()) % 1000 / 1000  # not hash(): salted per process
        return h >= world.HOLE_PUNCH_SUCCESS

    def rtt(self, a: Peer, b: Peer) -> float:
        key = (a.id, b.id) if a.id < b.id else (b.id, a.id)
        r = self._rtt_cache.get(key)
        if r is None:
            if self.relayed(a, b):
                r = (world.path_rtt(a.city, a.relay) + world.path_rtt(a.relay, b.city)
                     + 2 * (a.access + b.access + world.DC_ACCESS_S[1]))
            else:
                r = world.path_rtt(a.city, b.city) + 2 * (a.access + b.access)
            self._rtt_cache[key] = r
        return r

    def gateway_rtt(self, g: Gateway, p: Peer) -> float:
        key = (g.name, p.id)
        r = self._rtt_cache.get(key)
        if r is None:
            r = self._rtt_cache[key] = world.path_rtt(g.city, p.city) + 2 * (p.access + world.DC_ACCESS_S[1])
        return r

    # -- events ----------------------------------------------------------------------------------
    def at(self, t: float, fn) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def later(self, dt: float, fn) -> None:
        self.at(self.now + dt, fn)

    def run(self, progress: Callable[[float], None] | None = None) -> Stats:
        """Simulate to the end; ``progress(simulated seconds)`` is called every simulated
        ``PROGRESS_S``."""
        # the swarm assembles over its first five minutes; then arrivals keep it at its size
        for _ in range(self.target_peers):
            self.at(self.world_rng.uniform(0, 300), self.join)
        self.at(self.world_rng.expovariate(self.target_peers / self.mean_session), self.arrival_of_peer)
        t = 0.0
        next_sample = 0.0
        next_progress = PROGRESS_S
        while t < self.end:
            while self._events and self._events[0][0] <= t:
                when, _, fn = heapq.heappop(self._events)
                self.now = when
                fn()
            self.now = t
            self.tick(TICK_S)
            if t >= next_sample:
                self.sample()
                self.policy.tick(self)
                next_sample += SAMPLE_S
            if progress is not None and t >= next_progress:
                progress(t)
                next_progress += PROGRESS_S
            t += TICK_S
        self.close_gaps()
        return self.stats

    def arrival_of_peer(self) -> None:
        self.join()
        self.later(self.world_rng.expovariate(self.target_peers / self.mean_session), self.arrival_of_peer)

    # -- peers -----------------------------------------------------------------------------------
    def join(self) -> None:
        p = self._new_peer(self.now)
        if p.n_layers < 1:
            return  # not even one layer fits: it cannot join (the real peer exits with an error)
        self.peers[p.id] = p
        self.stats.joins += 1
        self.at(p.leaves_at, lambda: self.leave(p))
        decide = 0.0
        if self.policy.decentralized:
            # a lookup (DHT hops, then the claims and pings of the providers), a random wait, a
            # second look (compute_peer.choose_span and recheck_span)
            decide = 2 * self.lookup_seconds(p) + self.rng.uniform(*RECHECK_DELAY)
            self.count_lookup(p, 2)
        self.later(decide, lambda: self._chosen(p))

    def lookup_seconds(self, p: Peer) -> float:
        hops = max(1, math.ceil(math.log2(max(2, len(self.peers))) / 3))
        return hops * 0.1 + 0.3  # a hop is a round trip to a peer ~0.1 s away; then pings

    def _chosen(self, p: Peer) -> None:
        if p.gone:
            return
        span = self.policy.choose(self, p)
        p.target = span
        self._replan(p)
        if self.announce_loading:
            self._put_claim(p)  # a claim of the span it loads (not routable)
            self.count_publish()
        self.later(self.load_seconds(p, span, held=None), lambda: self._loaded(p, span, first=True))

    def load_seconds(self, p: Peer, span: tuple[int, int], held: tuple[int, int] | None) -> float:
        need = [i for i in range(*span) if held is None or not held[0] <= i < held[1]]
        nbytes = sum(self.model.layer_bytes(i) for i in need)
        speed = world.DISK_MBS if (p.cached and held is None) else p.downlink_mbs
        return nbytes / (speed * 1e6) + 5.0  # + loading into GPU memory, measuring throughput

    def _loaded(self, p: Peer, span: tuple[int, int], *, first: bool) -> None:
        if p.gone or p.target != span:
            return
        if first:
            self.stats.placed_s.append(self.now - p.joined)
            p.since = self.now
            self.later(self.rng.uniform(0, REPUBLISH_S), lambda: self._republish(p))
            # the first look comes soon, as a peer that only just chose its span looks (maintain)
            first_look = upkeep_step(DEFAULT_REBALANCE_INTERVAL, gap=False, settling=True)
            self.later(first_look * self.rng.uniform(*UPKEEP_JITTER), lambda: self._upkeep(p))
        self._set_span(p, span)
        p.moving = False
        p.settle_until = self.now + SETTLE_S
        self.publish(p)

    def _upkeep(self, p: Peer) -> None:
        if p.gone:
            return
        self.measure_successors(p)
        self.publish(p)  # upkeep ends with publisher.refresh()
        nxt = self.policy.upkeep(self, p)
        if nxt is not None:
            self.later(nxt, lambda: self._upkeep(p))

    def _republish(self, p: Peer) -> None:
        if p.gone:
            return
        self.publish(p)
        self.later(REPUBLISH_S, lambda: self._republish(p))

    def move(self, p: Peer, span: tuple[int, int]) -> None:
        """Load ``span`` (the old one served meanwhile), then switch to it."""
        if p.gone or span == p.target:
            return
        held = p.span
        p.target, p.moving = span, True
        self.stats.moves += 1
        self._replan(p)
        self.publish(p)  # the claim names the span being loaded
        self.later(self.load_seconds(p, span, held), lambda: self._loaded(p, span, first=False))

    def _set_span(self, p: Peer, span: tuple[int, int] | None) -> None:
        if p.span is not None:
            for i in range(*p.span):
                self.layer_count[i] -= 1
                if self.layer_count[i] == 0:
                    self.stats.uncovered_since[i] = (self.now, self.spare_capacity())
        p.span = span
        if span is not None:
            p._steps.clear()
            for i in range(*span):
                self.layer_count[i] += 1
                if self.layer_count[i] == 1 and i in self.stats.uncovered_since:
                    since, spare = self.stats.uncovered_since.pop(i)
                    if since >= self.warmup_s:
                        self.stats.gaps.append((self.now - since, spare))
            self._put_claim(p)
        else:
            self._drop_claim(p)
        self._replan(p)

    def close_gaps(self) -> None:
        for i, (since, spare) in list(self.stats.uncovered_since.items()):
            if since >= self.warmup_s:
                self.stats.gaps.append((self.end - since, spare))

    def spare_capacity(self) -> bool:
        """Whether some serving peer could move without leaving a layer unserved."""
        return any(all(self.layer_count[i] >= 2 for i in range(*p.span))
                   for p in self.peers.values() if p.span is not None and not p.gone)

    def leave(self, p: Peer) -> None:
        if p.gone:
            return
        p.gone = True
        self.stats.leaves += 1
        self._set_span(p, None)
        self._drop_claim(p)
        self._replan(p)
        self.peers.pop(p.id, None)
        for r in list(self.requests):
            if r.route and any(c.peer == p.id for c in r.route):
                self.fail_hop(r, p)
        for g in self.gateways:
            self.later(self.rng.uniform(0, RTT_CACHE_S), lambda g=g: g.known_gone.add(p.id))

    def claim_of(self, p: Peer) -> Claim:
        """The claim the peer publishes now (``ComputePeer.claim``): its span, and the one it is
        loading; before its first span is in, the one it is loading only."""
        loading = p.target if p.target != p.span and self.announce_loading else None
        s, e = p.span or p.target
        load = min(1.0, p.kv_used / p.kv_bytes)
        free = max(0, p.kv_bytes - p.kv_used) // (self.model.kv_bytes_per_token * (e - s))
        return Claim(model=self.model.name, start=s, end=e, kv_tokens=free if p.span else 0,
                     tput=p.tput_at(s, e) if p.span else 0.0,
                     addrs=(), expires=self.now + CLAIM_TTL, peer=p.id, reach="private" if p.nat else "public",
                     load=load, rtts=p.rtts, loading=loading)

    def publish(self, p: Peer) -> None:
        """A claim publication: a DHT put and provide, and a gossip message."""
        if p.span is None:
            return
        self._put_claim(p)
        self.count_publish()

    def _put_claim(self, p: Peer) -> None:
        old = self.claims.get(p.id)
        c = self.claims[p.id] = self.claim_of(p)  # a newer claim keeps the peer's place in the view
        if old is not None and old.start != c.start:
            self.by_start.get(old.start, {}).pop(p.id, None)
        self.claim_ids.add(p.id)
        self.by_start.setdefault(c.start, {})[p.id] = None

    def _drop_claim(self, p: Peer) -> None:
        old = self.claims.pop(p.id, None)
        if old is not None:
            self.by_start.get(old.start, {}).pop(p.id, None)
        self.claim_ids.discard(p.id)

    def count_publish(self) -> None:
        n = max(2, len(self.peers))
        self.stats.msgs["dht"] += 2 * (DHT_ALPHA * math.ceil(math.log2(n)) + DHT_K)
        self.stats.msgs["gossip"] += GOSSIP_D * n  # every subscriber hears it from its mesh

    def count_lookup(self, p: Peer, times: int = 1) -> None:
        n = max(2, len(self.peers))
        self.stats.msgs["dht"] += times * (DHT_ALPHA * math.ceil(math.log2(n)) + 2 * min(64, len(self.claims)))

    def measure_successors(self, p: Peer) -> None:
        """Round trips to the peers serving the layers after its own, reported in its claim."""
        if p.span is None:
            return
        nxt = [self.peers[q] for q in itertools.islice(self.by_start.get(p.span[1], ()), 32) if q in self.peers]
        p.rtts = tuple((q.id, self.rtt(p, q)) for q in nxt[:MAX_RTTS])
        self.stats.msgs["ping"] += len(nxt)

    def view_of(self, p: Peer, most: int | None) -> list[Claim]:
        """The live claims a peer's lookup finds (``most`` providers; None: all), not its own."""
        if most is None:
            return [c for peer, c in self.claims.items() if peer != p.id]
        picked = self.claim_ids.sample(self.rng, most + 1)
        return [self.claims[peer] for peer in picked if peer != p.id][:most]

    def planned_served(self, without: Peer | None = None) -> list[float]:
        """Per layer, the tokens/s of every peer serving or loading it (a central view; kept up
        to date as peers change, not recounted)."""
        if without is None or without.id not in self._planned_by:
            return list(self._planned)
        s, e, t = self._planned_by[without.id]
        return [x - t if s <= i < e else x for i, x in enumerate(self._planned)]

    def _replan(self, p: Peer) -> None:
        """Move ``p``'s share of the planned vector to where it is going (or out, once gone)."""
        old = self._planned_by.pop(p.id, None)
        if old is not None:
            for i in range(old[0], old[1]):
                self._planned[i] -= old[2]
        span = None if p.gone else (p.target or p.span)
        if span:
            t = p.tput_at(*span)
            self._planned_by[p.id] = (*span, t)
            for i in range(*span):
                self._planned[i] += t

    # -- requests --------------------------------------------------------------------------------
    def tick(self, dt: float) -> None:
        self.stats.peers_hours += len(self.peers) * dt / 3600
        if self.now >= self.warmup_s:
            self.stats.observed_s += dt
            if min(self.layer_count) > 0:
                self.stats.covered_s += dt
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

    def usable(self, g: Gateway, avoid: set[str]) -> list[Claim]:
        return [c for c in self.claims.values() if c.peer not in g.known_gone and c.peer not in avoid]

    def route(self, r: Request, *, avoid: set[str] = frozenset(), keep: list[Claim] | None = None,
              or_wait: bool = False) -> bool:
        """Choose ``r``'s chain and try to open it. ``or_wait``: when no chain avoids ``avoid``,
        keep the chain it has (False returned) instead of failing."""
        g = r.gateway
        usable = self.usable(g, avoid)
        self.probe(g, [c.peer for c in usable])
        if self.suffix_entry:
            usable = usable + [dataclasses.replace(c, start=b, tput=c.tput * (c.end - c.start) / (c.end - b))
                               for c in usable if c.serving for b in range(c.start + 1, c.end)]

        def rtt(peer: str) -> float:
            q = self.peers.get(peer)
            return link_rtt(g.rtts.get(peer), relayed=False) if q is not None else link_rtt(None)

        t0 = wallclock.perf_counter()
        try:
            route = plan_route(usable, self.model.num_layers,
                               cost=ChainCost(rtt, kept=frozenset(c.peer for c in keep or ()),
                                              load=g.own.load if self.route_by_load else _no_load),
                               rng=self.rng)
        except NoRouteError:
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
            q = self.peers.get(peer)
            g.probed_at[peer] = self.now
            self.stats.msgs["ping"] += 1
            if q is None:
                g.known_gone.add(peer)
            else:
                g.rtts[peer] = self.gateway_rtt(g, q)

    def try_open(self, r: Request) -> None:
        """Open the chain's sessions when every hop has KV room; else wait in line (the client
        retries the same chain) until QUEUE_TIMEOUT."""
        hops = [self.peers.get(c.peer) for c in r.route]
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
                self._load_changed(q)
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
            if self.route(r, avoid=full, keep=[c for c in r.route if c.peer not in full], or_wait=True):
                r.waiting_since = since  # the line it waits in is the same request's

    def _load_changed(self, q: Peer) -> None:
        if self.load_step and q.span is not None and q.id in self.claims:
            published = self.claims[q.id].load
            if int(published / self.load_step) != int(min(1.0, q.kv_used / q.kv_bytes) / self.load_step):
                self.publish(q)

    def chain_rtt(self, r: Request) -> float:
        total, prev = 0.0, None
        for c in r.route:
            q = self.peers[c.peer]
            total += (self.gateway_rtt(r.gateway, q) if prev is None else self.rtt(prev, q)) / 2
            prev = q
        return total + self.gateway_rtt(r.gateway, prev) / 2

    def rate(self, r: Request) -> float:
        step = sum(self.peers[c.peer].step(self.peers[c.peer].sessions) for c in r.route)
        return 1.0 / (self.chain_rtt(r) + step)

    def release(self, r: Request) -> None:
        if r.open:
            for c, n in zip(r.route, r.kv_each):
                q = self.peers.get(c.peer)
                if q is not None:
                    q.kv_used -= n
                    q.sessions -= r.cohort
                    q.open_spans[(c.start, c.end)] -= r.cohort
                    if q.open_spans[(c.start, c.end)] <= 0:
                        del q.open_spans[(c.start, c.end)]
                    self._load_changed(q)
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

        self.at(self.now + notice, heal)

    def heal(self, r: Request, failed: str) -> bool:
        """Route ``r`` around the peer that failed, keeping the rest of its chain (as
        ``find_route(avoid=failed, keep=chain)``); the gateway knows that peer gone now."""
        r.gateway.known_gone.add(failed)
        if r.arrived >= self.warmup_s:
            self.stats.heals += r.cohort
        return self.route(r, avoid={failed}, keep=[c for c in r.route or () if c.peer != failed])

    # -- measurements ----------------------------------------------------------------------------
    def sample(self) -> None:
        if self.now < self.warmup_s:
            return
        present = [p for p in self.peers.values() if not p.gone]
        bound = lp_bound(present, self.model.num_layers)
        flow = placement_flow(present, self.model.num_layers, suffix_entry=self.suffix_entry)
        delivered = sum(r.rate * r.cohort for r in self.requests if r.open and self.now >= r.stalled_until)
        self.stats.samples.append({"t": self.now, "peers": len(present), "bound": bound, "flow": flow,
                                   "delivered": delivered, "covered": min(self.layer_count) > 0,
                                   "routable": flow > 0,
                                   "served_min": min(self.layer_count), "active": sum(r.cohort for r in self.requests)})


class SampleSet:
    """A set that draws random members in O(k) (a list with an index)."""

    def __init__(self) -> None:
        self._items: list[str] = []
        self._at: dict[str, int] = {}

    def add(self, x: str) -> None:
        if x not in self._at:
            self._at[x] = len(self._items)
            self._items.append(x)

    def discard(self, x: str) -> None:
        i = self._at.pop(x, None)
        if i is not None:
            last = self._items.pop()
            if i < len(self._items):
                self._items[i] = last
                self._at[last] = i

    def sample(self, rng: random.Random, k: int) -> list[str]:
        return rng.sample(self._items, min(k, len(self._items)))

    def __len__(self) -> int:
        return len(self._items)


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


_LAYER_CAPACITY: dict[tuple[str, str, int], float] = {}


def layer_capacity(p: Peer) -> float:
    """The most layer-tokens per second a peer can give: over the span lengths it can hold, the
    span's capacity times its length."""
    key = (p.model.name, p.gpu.name, p.n_layers)
    if key not in _LAYER_CAPACITY:
        L = p.model.num_layers
        # per length, the window with the most light (dense) layers first or last is the fastest
        _LAYER_CAPACITY[key] = max(k * capacity_at(p, s, s + k) for k in range(1, p.n_layers + 1)
                                   for s in (0, L - k))
    return _LAYER_CAPACITY[key]


def lp_bound(peers: list[Peer], num_layers: int) -> float:
    """An upper bound on any placement's throughput over these peers (tokens/s): every token
    needs ``num_layers`` layer-computations, and no peer gives more layer-tokens per second than
    ``layer_capacity`` (the LP relaxation of placement with every span length allowed)."""
    return sum(layer_capacity(p) for p in peers) / num_layers


def placement_flow(peers: list[Peer], num_layers: int, *, suffix_entry: bool = False) -> float:
    """The max flow through the spans as placed (tokens/s): what perfect routing could carry.

    A peer that moved serves its old span too while sessions opened on it remain: its capacity
    is split between its spans in proportion to their sessions (the current span takes the
    rest), since one GPU computes both (the simulation runs every session of a peer at the
    current span's step time, so no span gets more than that share). With ``suffix_entry`` a
    span can be entered at any of its layers."""
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(range(num_layers + 1))
    for p in peers:
        if p.span is None:
            continue
        cap = p.capacity()
        total = sum(p.open_spans.values())
        shares = {span: n / total for span, n in p.open_spans.items() if span != p.span and total}
        shares[p.span] = max(0.0, 1.0 - sum(shares.values()))
        for (s, e), share in shares.items():
            if share <= 0:
                continue
            if suffix_entry:
                node = ("span", p.id, s, e)
                g.add_edge(node, e, capacity=cap * share)
                for b in range(s, e):
                    g.add_edge(b, node)  # no capacity: unbounded
            elif g.has_edge(s, e):
                g[s][e]["capacity"] += cap * share
            else:
                g.add_edge(s, e, capacity=cap * share)
    if not nx.has_path(g, 0, num_layers):
        return 0.0
    return float(nx.maximum_flow_value(g, 0, num_layers, flow_func=nx.algorithms.flow.edmonds_karp))
