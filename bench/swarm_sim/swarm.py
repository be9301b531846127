"""The simulated swarm: compute peers that join, choose and claim spans, move and leave, and what
their publications and lookups cost in messages.

Placement is the policy's (bench/swarm_sim/policies.py: ``shardnet`` is
``shardnet.inference.server.placement`` called as a compute peer calls it); a peer's claim is a
real ``Claim`` (its span, the one it is loading, tokens/s, load, free KV tokens, its successors'
round trips), published by the claim publisher's rules (``ClaimPublisher``): it looks on joining,
at every upkeep and when a refresh is due; a claim that is news against the one it published last
(``block_claim.news``) gets a new version and goes out on gossip and in the DHT; otherwise, once
``REPUBLISH_S`` has passed since the last put, the same version goes in the DHT again (a put and
a provide, no gossip).

- Peers arrive as a Poisson process that keeps the swarm at its size, each for a Weibull
  session (bench/swarm_sim/world.py), and leave closing their connections (``graceful``) or
  vanishing; who comes, when, with what and for how long draws on its own random stream, so
  every policy meets the same peers.
- A joining peer looks the swarm up (DHT hops, then the providers' claims and pings), waits
  (``RECHECK_DELAY``), looks again and chooses; it loads its span from disk or its downlink,
  then serves and claims it. A move loads the new span while the old one serves.
- Messages are counted, not sent, by kind (gossip, dht, ping, direct), with their bytes
  (bench/swarm_sim/wire.py: a claim's size measured with the real encoder, the rest estimated
  from the protocols' formats): estimated from the protocols' parameters (``DHT_ALPHA``,
  ``DHT_K``, ``GOSSIP_D``) for each publication and lookup.
- Claims travel by layer range (dissemination 2, docs/protocols.md; the ranges are
  ``block_claim.layer_ranges``): a news goes out on the topic of the range holding its claim's
  first layer (``block_claim.claim_ranges``; and that of the span it loads), each delivered ``GOSSIP_D`` times (the
  mesh's duplicates) to every compute peer subscribed to that topic but the publisher; a compute
  peer's claims view subscribes to the ranges of ``neighbourhood(its span)`` when it starts and
  again whenever its span changes; gateways follow every range's topic. A publication puts the claim
  record (one key) and, when its refresh is due, provides under those ranges (news provides
  under the ranges it did not cover yet). A lookup (``find_claims``) is, per range, a
  find_providers walk that returns a random sample of at most ``LOOKUP_PROVIDERS_PER_RANGE``
  of that range's providers, then one direct request per distinct provider. A compute peer's
  view looks every range up every ``UPKEEP_LOOKUP_S``, a gateway's every
  ``claims_view.REFRESH_S`` and when a request finds no route (traffic.py).
- What a view holds: a claim whose news the view heard (on a topic it was subscribed to when
  the news went out) until it expires (``CLAIM_TTL`` after it was built), and the claims its
  own lookups got (``looked_up``: peer -> expiry); a refresh is not gossiped. It holds the
  peer's current claim (a stale version it would hold in fact is not modelled). Compute peers
  decide from their view (``view_claims``; when it holds more than ``VIEW_DECIDE_MOST``,
  random samples of it that stand for the rest); at each upkeep they count the peers they are connected to live
  (``CONNECTED``: the connection manager's high watermark) and ping at most ``UPKEEP_PINGS`` of
  the others of their view, dialling them first.

A peer's departure is handed to ``on_leave`` (the traffic's: requests through it heal).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from libp2p.kad_dht.common import ALPHA, BUCKET_SIZE

from bench.swarm_sim import wire, world
from bench.swarm_sim.events import EventLoop
from bench.swarm_sim.models import ModelSpec
from bench.swarm_sim.stats import Stats
from shardnet.inference.claims import CLAIM_TTL, LOOKUP_PROVIDERS_PER_RANGE, RTT_SAMPLES
from shardnet.inference.claims_view import CROWDED_NEWS, CROWDED_PAUSE_S, CROWDED_WINDOW_S
from shardnet.inference.server.claim_publisher import NEWS_PUT_GAP_S, PROVIDE_REFRESH_S
from shardnet.inference.server.placement import (
    DEFAULT_REBALANCE_INTERVAL,
    MEMORY_USE,
    SETTLE_S,
    UPKEEP_JITTER,
    layers_fitting,
    upkeep_step,
)
from shardnet.protocols.block_claim import MAX_RTTS, Claim, claim_ranges, layer_ranges, neighbourhood, news, ranges_of
from shardnet.transport.config import NodeConfig

#: the most tokens one forward pass of a peer's block scheduler takes (scheduler.DEFAULT_MAX_TOKENS,
#: not imported: that module needs torch); more sessions take more passes
BATCH_TOKENS = 256
#: the claim publisher puts its claim in the DHT again (and provides) a third of the TTL after
#: its last put (claim_publisher.py)
REPUBLISH_S = CLAIM_TTL / 3
#: compute_peer.UPKEEP_LOOKUP_S (not imported: that module needs torch; a test keeps them equal):
#: a compute peer's claims view looks up this often, gossip bringing news in between
UPKEEP_LOOKUP_S = CLAIM_TTL / 2
#: compute_peer.UPKEEP_PINGS: the most unconnected claims one upkeep round pings
UPKEEP_PINGS = 16
#: compute_peer.SUCCESSOR_RTT_MAX_AGE_S: a successor's round trip is measured again this late
SUCCESSOR_RTT_MAX_AGE_S = 600.0
#: the most claims of its view a simulated compute peer plans over (``Swarm.view_claims``: half
#: of them a sample of what its lookups got, half of the news it heard, their tokens/s scaled
#: up to stand for the rest): planning over thousands of claims at every upkeep of 10,000 peers
#: is too slow for this simulator; the real peer plans over its whole view (docs/scale.md)
VIEW_DECIDE_MOST = 512
#: the connections a peer holds (the connection manager prunes above its high watermark): the
#: peers of its view that upkeep counts live without a ping
CONNECTED = NodeConfig().high_watermark
#: compute_peer.RECHECK_DELAY
RECHECK_DELAY = (0.5, 2.5)
#: Kademlia: py-libp2p's concurrency (kad_dht/common.py ALPHA) and replication (BUCKET_SIZE)
DHT_ALPHA, DHT_K = ALPHA, BUCKET_SIZE
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
    #: successor -> when its round trip was last measured
    rtt_measured: dict = field(default_factory=dict)
    since: float = 0.0
    #: the claim last published as news (its ``seq`` the version others hold); when the claim
    #: was last put in the DHT and last built (what a direct request answers)
    published: Claim | None = None
    last_put: float = -math.inf
    last_provide: float = -math.inf
    #: a news not in the DHT yet (``NEWS_PUT_GAP_S``), and whether its put is scheduled
    put_pending: bool = False
    put_scheduled: bool = False
    last_look: float = -math.inf
    publishing: bool = False
    view_started: bool = False
    #: the claim topics (layer ranges) its view is subscribed to, each since when
    subs: dict = field(default_factory=dict)
    #: the followed ranges it left for being crowded (``claims_view.CROWDED_NEWS``): range ->
    #: (subscribed since, left when, resumes when)
    paused: dict = field(default_factory=dict)
    #: the ranges its publisher provided under since its last refresh
    provided: frozenset = frozenset()
    #: peer -> expiry of the claim its view's lookups got from that peer
    looked_up: dict = field(default_factory=dict)
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


class Policy:
    """A placement policy (bench/swarm_sim/policies.py): what the swarm asks of one."""

    name = "?"
    #: whether peers look the swarm up (DHT lookups, pings) to decide
    decentralized = True
    #: whether upkeep reads the node's gossip-fed claims view (shardnet's compute peers), looked
    #: up every UPKEEP_LOOKUP_S, its unconnected peers pinged at each upkeep
    claims_view = False

    def choose(self, swarm: Swarm, peer: Peer) -> tuple[int, int]:
        raise NotImplementedError

    def upkeep(self, swarm: Swarm, peer: Peer) -> float | None:
        """Called at the peer's upkeep time; may start a move (``swarm.move``). Returns the
        seconds until the next upkeep, or None for none."""
        return None

    def tick(self, swarm: Swarm) -> None:
        """Called once a simulated minute (a central scheduler's chance to act)."""


class Swarm:
    """The peers of one model's swarm on ``clock``, placed by ``policy``; ``world_rng`` draws the
    peers (who comes, when, with what, for how long), ``rng`` the decisions of the code under test."""

    def __init__(self, *, model: ModelSpec, policy: Policy, target_peers: int, clock: EventLoop, stats: Stats,
                 world_rng: random.Random, rng: random.Random, warmup_s: float, announce_loading: bool = True,
                 load_step: float | None = None) -> None:
        self.model, self.policy, self.target_peers = model, policy, target_peers
        self.clock, self.stats = clock, stats
        self.world_rng, self.rng = world_rng, rng
        self.warmup_s = warmup_s
        #: peers claim the span they are loading (``Claim.loading``), as shardnet peers do now
        self.announce_loading = announce_loading
        #: what if a peer's publisher looked whenever its load crossed a multiple of this (None:
        #: only at its upkeep and when a refresh is due, as shardnet does); ``news`` decides
        self.load_step = load_step
        #: until when gossip keeps each peer's claim in views: its last news' expiry
        self.heard_until: dict[str, float] = {}
        #: each peer's last news: when, and on which ranges' topics
        self.news_of: dict[str, tuple[float, tuple[int, ...]]] = {}
        self.ranges = layer_ranges(model.num_layers)
        #: per range, the peers whose claim starts in it (its providers), and the compute peers
        #: whose view is subscribed to its topic
        self.providers = [SampleSet() for _ in self.ranges]
        self._provider_ranges: dict[str, tuple[int, ...]] = {}
        #: per range, the compute peers subscribed to its topic, in the order they subscribed
        self.subscribers: list[dict[str, None]] = [{} for _ in self.ranges]
        #: per range, the peers whose news went out on its topic within ``CROWDED_WINDOW_S``:
        #: peer -> its last news there, oldest first
        self.topic_news: list[OrderedDict] = [OrderedDict() for _ in self.ranges]
        #: how many gateways follow every range's topic (a gateway routes through every range:
        #: its view hears every news, as ``Gateway`` makes it do; set by the traffic)
        self.gateway_followers = 0
        self._claim_bytes: dict[str, int] = {}
        self._claim_bytes_total = 0
        self.peers: dict[str, Peer] = {}
        self.claims: dict[str, Claim] = {}  # peers' claims, in the order they first claimed
        self.claim_ids = SampleSet()  # the same peers, to draw a lookup's providers from
        self.by_start: dict[int, dict[str, None]] = {}  # claims by first layer, in claim order
        self._planned = [0.0] * model.num_layers
        self._planned_by: dict[str, tuple[int, int, float]] = {}
        self.layer_count = [0] * model.num_layers
        self._peer_ids = itertools.count()
        self._rtt_cache: dict[tuple[str, str], float] = {}
        self.mean_session = self._mean_session()
        #: called with each peer that leaves, once it is gone from the swarm
        self.on_leave: Callable[[Peer], None] = lambda p: None

    @property
    def now(self) -> float:
        return self.clock.now

    # -- the world -------------------------------------------------------------------------------
    def _mean_session(self) -> float:
        dc = sum(g.share for g in world.GPUS if g.datacenter)
        home = 1 - dc
        g = math.gamma(1 + 1 / world.CHURN_SHAPE) / math.log(2) ** (1 / world.CHURN_SHAPE)
        return g * (home * world.HOME_MEDIAN_S + dc * world.DC_MEDIAN_S)

    def new_peer(self, t: float) -> Peer:
        """The next peer of the world, joining at ``t`` (not yet joined)."""
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

    # -- peers -----------------------------------------------------------------------------------
    def start(self) -> None:
        """The swarm assembles over its first five minutes; then arrivals keep it at its size."""
        for _ in range(self.target_peers):
            self.clock.at(self.world_rng.uniform(0, 300), self.join)
        self.clock.at(self.world_rng.expovariate(self.target_peers / self.mean_session), self.arrival_of_peer)

    def arrival_of_peer(self) -> None:
        self.join()
        self.clock.later(self.world_rng.expovariate(self.target_peers / self.mean_session), self.arrival_of_peer)

    def tick(self, dt: float) -> None:
        """Account ``dt`` simulated seconds: peer-hours, and (after the warm-up) whether every
        layer was served."""
        self.stats.peers_hours += len(self.peers) * dt / 3600
        if self.now >= self.warmup_s:
            self.stats.observed_s += dt
            self.stats.observed_peer_s += len(self.peers) * dt
            if min(self.layer_count) > 0:
                self.stats.covered_s += dt

    def join(self) -> None:
        p = self.new_peer(self.now)
        if p.n_layers < 1:
            return  # not even one layer fits: it cannot join (the real peer exits with an error)
        self.peers[p.id] = p
        self.stats.joins += 1
        self.clock.at(p.leaves_at, lambda: self.leave(p))
        decide = 0.0
        if self.policy.decentralized:
            # a lookup (DHT hops, then the claims and pings of the providers), a random wait, a
            # second look (compute_peer.choose_span and recheck_span)
            decide = 2 * self.lookup_seconds(p) + self.rng.uniform(*RECHECK_DELAY)
            self.count_lookup(p, 2)
        self.clock.later(decide, lambda: self._chosen(p))

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
            self.look(p)  # a claim of the span it loads (not routable)
            self._start_publishing(p)
        self.clock.later(self.load_seconds(p, span, held=None), lambda: self._loaded(p, span, first=True))

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
            # the first look comes soon, as a peer that only just chose its span looks (maintain)
            first_look = upkeep_step(DEFAULT_REBALANCE_INTERVAL, gap=False, settling=True)
            self.clock.later(first_look * self.rng.uniform(*UPKEEP_JITTER), lambda: self._upkeep(p))
        self._set_span(p, span)
        p.moving = False
        p.settle_until = self.now + SETTLE_S
        self.publish(p)
        self._start_publishing(p)

    def _upkeep(self, p: Peer) -> None:
        if p.gone:
            return
        if not p.view_started:
            # the view starts at the first upkeep: subscribed to its neighbourhood's topics
            # (whatever the placement policy: gossip costs the same), then, for a policy that
            # reads the view, a lookup of every range and one every UPKEEP_LOOKUP_S
            p.view_started = True
            self.subscribe(p)
            if self.policy.claims_view:
                self._view_lookup(p)
        self.measure_successors(p)
        self.publish(p)  # upkeep ends with publisher.refresh()
        nxt = self.policy.upkeep(self, p)
        if nxt is not None:
            self.clock.later(nxt, lambda: self._upkeep(p))

    def _view_lookup(self, p: Peer) -> None:
        if p.gone:
            return
        self.look_up_into(p.looked_up)
        self.clock.later(UPKEEP_LOOKUP_S, lambda: self._view_lookup(p))

    def _start_publishing(self, p: Peer) -> None:
        if not p.publishing:
            p.publishing = True
            self.clock.at(p.last_put + REPUBLISH_S, lambda: self._republish(p))

    def _republish(self, p: Peer) -> None:
        """The publisher wakes when its refresh is due (a third of the TTL after its last put)."""
        if p.gone:
            return
        if self.now >= p.last_put + REPUBLISH_S - 1e-6:
            self.look(p, refresh_due=True)
        self.clock.at(p.last_put + REPUBLISH_S, lambda: self._republish(p))

    def move(self, p: Peer, span: tuple[int, int]) -> None:
        """Load ``span`` (the old one served meanwhile), then switch to it."""
        if p.gone or span == p.target:
            return
        held = p.span
        p.target, p.moving = span, True
        self.stats.moves += 1
        self._replan(p)
        self.publish(p)  # the claim names the span being loaded
        self.clock.later(self.load_seconds(p, span, held), lambda: self._loaded(p, span, first=False))

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
        if p.view_started:
            self.subscribe(p)  # the view follows the span's neighbourhood
        self._replan(p)

    def followed_ranges(self, span: tuple[int, int]) -> set[int]:
        """The ranges a compute peer serving ``span`` follows: ``block_claim.neighbourhood``, or,
        with the policy's ``follow_edges`` what-if, the range of its first layer and that of the
        layer after it."""
        L = self.model.num_layers
        if getattr(self.policy, "follow_edges", False):
            s, e = span
            return set(ranges_of(s, s + 1, L)) | set(ranges_of(e, e + 1, L))
        return set(neighbourhood(*span, L))

    def subscribe(self, p: Peer) -> None:
        """Subscribe ``p``'s view to the topics of ``neighbourhood(its span)`` (none once it
        serves nothing), leaving the others; a topic joined now hears news from now on. A range
        it left for being crowded stays left until its pause ends (``_resume``), unless it stops
        following it meanwhile."""
        want = self.followed_ranges(p.span) if p.span is not None and not p.gone else set()
        for r in set(p.paused) - want:
            del p.paused[r]
        want -= p.paused.keys()
        for r in set(p.subs) - want:
            del p.subs[r]
            self.subscribers[r].pop(p.id, None)
        for r in want - set(p.subs):
            p.subs[r] = self.now
            self.subscribers[r][p.id] = None

    def _crowd_out(self, r: int, publisher: str) -> None:
        """``publisher``'s news went out on range ``r``'s topic: every subscriber that heard news
        from ``CROWDED_NEWS`` different peers within ``CROWDED_WINDOW_S`` leaves it for
        ``CROWDED_PAUSE_S`` (``ClaimsView``; its lookups still cover the range). Subscribers are
        in the order they subscribed, so those that heard enough are the first ones."""
        recent = self.topic_news[r]
        recent.pop(publisher, None)
        recent[publisher] = self.now
        while recent and next(iter(recent.values())) < self.now - CROWDED_WINDOW_S:
            recent.popitem(last=False)
        if len(recent) < CROWDED_NEWS:
            return
        # subscribed by the CROWDED_NEWS-th latest publisher's news: it heard that many
        since = next(itertools.islice(reversed(recent.values()), CROWDED_NEWS - 1, None))
        subs = self.subscribers[r]
        while subs:
            q = self.peers.get(next(iter(subs)))
            if q is None or q.subs.get(r, math.inf) > since:
                break
            del subs[q.id]
            until = self.now + CROWDED_PAUSE_S
            q.paused[r] = (q.subs.pop(r), self.now, until)
            self.clock.later(CROWDED_PAUSE_S, lambda q=q, r=r, until=until: self._resume(q, r, until))

    def _resume(self, p: Peer, r: int, until: float) -> None:
        if p.gone or p.paused.get(r, (None, None, None))[2] != until:
            return
        del p.paused[r]
        self.subscribe(p)

    def close_gaps(self) -> None:
        for i, (since, spare) in list(self.stats.uncovered_since.items()):
            if since >= self.warmup_s:
                self.stats.gaps.append((self.clock.end - since, spare))

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
        self.on_leave(p)

    # -- claims ----------------------------------------------------------------------------------
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
        """The publisher looks again (``ClaimPublisher.refresh``) once the peer serves a span."""
        if p.span is not None:
            self.look(p)

    def claim_ranges(self, c: Claim) -> list[int]:
        """The layer ranges a claim is published and provided under (``block_claim.claim_ranges``)."""
        return claim_ranges(c, self.model.num_layers)

    def look(self, p: Peer, *, refresh_due: bool = False) -> None:
        """One round of ``ClaimPublisher.serve``: the claim built anew; news (``block_claim.news``
        against the last claim published) gets the next version, on the topic of every range it
        holds its first layer (``claim_ranges``), and in the DHT ``NEWS_PUT_GAP_S`` after the last
        put at the soonest; a refresh due puts the claim in the DHT (no gossip); news provides
        under the ranges not provided yet, and every ``PROVIDE_REFRESH_S`` it provides under all
        its ranges again."""
        fresh = self.claim_of(p)
        p.last_look = self.now
        reason = news(p.published, fresh)
        refresh_due = refresh_due or self.now - p.last_put >= REPUBLISH_S
        p.put_pending = p.put_pending or reason is not None
        put_due = refresh_due or (p.put_pending and self.now >= p.last_put + NEWS_PUT_GAP_S)
        if reason is None and not put_due:
            return
        size = wire.size_of(fresh)
        ranges = self.claim_ranges(fresh)
        if put_due:
            self.count_put(size)
            p.put_pending = False
            p.last_put = self.now
        elif not p.put_scheduled:  # the publisher wakes when the gap has passed
            p.put_scheduled = True
            self.clock.at(p.last_put + NEWS_PUT_GAP_S, lambda: self._put_news(p))
        if self.now - p.last_provide >= PROVIDE_REFRESH_S:
            self.count_provide(len(ranges))
            p.provided = frozenset(ranges)
            p.last_provide = self.now
        elif not p.provided.issuperset(ranges):
            self.count_provide(len(set(ranges) - p.provided))
            p.provided |= frozenset(ranges)
        if reason is not None:
            p.published = dataclasses.replace(fresh, seq=p.published.seq + 1 if p.published else 1)
            self._put_claim(p, p.published)
            self.heard_until[p.id] = fresh.expires
            self.news_of[p.id] = (self.now, ranges)
            self.count_gossip(size, ranges, publisher=p.id)
            if self.now >= self.warmup_s:
                self.stats.publications["news"] += 1
                self.stats.news_why[reason] += 1
        elif refresh_due and self.now >= self.warmup_s:
            self.stats.publications["refresh"] += 1

    def _put_news(self, p: Peer) -> None:
        p.put_scheduled = False
        if not p.gone and p.put_pending and p.span is not None:
            self.look(p)

    def load_changed(self, q: Peer) -> None:
        """``q``'s KV use changed: its publisher looks if ``load_step`` says so."""
        if self.load_step and q.span is not None and q.id in self.claims:
            published = self.claims[q.id].load
            if int(published / self.load_step) != int(min(1.0, q.kv_used / q.kv_bytes) / self.load_step):
                self.publish(q)

    def _put_claim(self, p: Peer, claim: Claim | None = None) -> None:
        old = self.claims.get(p.id)
        c = self.claims[p.id] = claim or self.claim_of(p)  # a newer claim keeps the peer's place in the view
        if old is not None and old.start != c.start:
            self.by_start.get(old.start, {}).pop(p.id, None)
        self.claim_ids.add(p.id)
        self.by_start.setdefault(c.start, {})[p.id] = None
        ranges = self.claim_ranges(c)
        for r in set(self._provider_ranges.get(p.id, ())) - set(ranges):
            self.providers[r].discard(p.id)
        for r in ranges:
            self.providers[r].add(p.id)
        self._provider_ranges[p.id] = ranges
        size = wire.size_of(c)
        self._claim_bytes_total += size - self._claim_bytes.get(p.id, 0)
        self._claim_bytes[p.id] = size

    def _drop_claim(self, p: Peer) -> None:
        old = self.claims.pop(p.id, None)
        if old is not None:
            self.by_start.get(old.start, {}).pop(p.id, None)
        self.claim_ids.discard(p.id)
        for r in self._provider_ranges.pop(p.id, ()):
            self.providers[r].discard(p.id)
        self._claim_bytes_total -= self._claim_bytes.pop(p.id, 0)
        self.heard_until.pop(p.id, None)
        self.news_of.pop(p.id, None)

    # -- what it costs ---------------------------------------------------------------------------
    def count(self, kind: str, msgs: float, nbytes: float) -> None:
        """Messages of ``kind`` and their bytes, counted after the warm-up (the swarm assembling)."""
        if self.now < self.warmup_s:
            return
        self.stats.msgs[kind] += msgs
        self.stats.bytes[kind] += nbytes

    def walk_rpcs(self) -> int:
        """The RPCs of one DHT walk: ``DHT_ALPHA`` at a time, a round per bit of the swarm's size."""
        return DHT_ALPHA * math.ceil(math.log2(max(2, len(self.peers))))

    def count_put(self, claim_bytes: int) -> None:
        """A DHT put: a walk to the key, then the record at the ``DHT_K`` closest peers."""
        w = self.walk_rpcs()
        self.count("dht", w + DHT_K, w * wire.walk_rpc() + DHT_K * wire.put_rpc(claim_bytes))

    def count_provide(self, ranges: int = 1) -> None:
        """ADD_PROVIDER under ``ranges`` keys: per key a walk to it, then the ``DHT_K`` closest peers."""
        w = self.walk_rpcs()
        self.count("dht", ranges * (w + DHT_K), ranges * (w * wire.walk_rpc() + DHT_K * wire.provide_rpc()))

    def count_gossip(self, claim_bytes: int, ranges: tuple[int, ...], publisher: str | None = None) -> None:
        """News on the topic of each of ``ranges``: every subscriber of that topic but the
        publisher (the compute peers following it, and every gateway) hears it from its mesh
        (``GOSSIP_D`` deliveries each: the duplicates), one message per topic."""
        n = sum(len(self.subscribers[r]) - (publisher in self.subscribers[r]) + self.gateway_followers
                for r in ranges)
        self.count("gossip", GOSSIP_D * n, GOSSIP_D * n * wire.gossip(claim_bytes))
        if publisher is not None and not getattr(self.policy, "follow_crowded", False):
            for r in ranges:
                self._crowd_out(r, publisher)

    def mean_claim_bytes(self) -> float:
        if not self._claim_bytes:
            return wire.claim_bytes("public", 0, False)
        return self._claim_bytes_total / len(self._claim_bytes)

    def lookup(self) -> dict[str, None]:
        """``find_claims`` over every layer range: per range a find_providers walk whose answers
        name a random sample of at most LOOKUP_PROVIDERS_PER_RANGE of its providers, then one
        direct request to each distinct provider, dialling those it holds no connection to
        (those whose connections it holds are answered on them; then all are connected, so the
        liveness check that follows pings none). Returns the providers asked."""
        asked: dict[str, None] = {}  # (a dict: in the order found, whatever the process's hash seed)
        named = 0
        for members in self.providers:
            got = members.sample(self.rng, LOOKUP_PROVIDERS_PER_RANGE)
            named += len(got)
            asked.update(dict.fromkeys(got))
        n = max(2, len(self.peers))
        w = self.walk_rpcs()
        walks = len(self.ranges)
        self.count("dht", walks * w, walks * w * wire.walk_rpc() + named * wire.PEER_INFO)
        unconnected = max(0.0, 1.0 - CONNECTED / n)
        self.count("direct", len(asked),
                   len(asked) * (wire.direct_request(self.mean_claim_bytes()) + unconnected * wire.DIAL))
        return asked

    def count_lookup(self, p: Peer | None = None, times: int = 1) -> None:
        """``times`` lookups of every range (``lookup``), counted."""
        for _ in range(times):
            self.lookup()

    def count_liveness(self, p: Peer, view: int) -> None:
        """Upkeep reading the claims view (``view`` claims): connected peers count live, at most
        ``UPKEEP_PINGS`` of the others are pinged (each dialled first), the rest trusted until
        they expire."""
        pings = min(UPKEEP_PINGS, max(0, view - CONNECTED))
        self.count("ping", pings, pings * (wire.PING + wire.DIAL))

    def visible(self, peer: str, looked_up: dict[str, float]) -> bool:
        """Whether a gateway's view holds ``peer``'s claim: heard as news (it follows every
        range's topic from the start) or found by one of its own lookups (``looked_up``: peer ->
        the expiry of the claim it got)."""
        return self.heard_until.get(peer, 0.0) > self.now or looked_up.get(peer, 0.0) > self.now

    def look_up_into(self, looked_up: dict[str, float]) -> None:
        """A view's lookup of every range: each provider asked answers the claim its publisher
        built last (expiring a TTL after that); expired entries leave the view."""
        for peer in [q for q, t in looked_up.items() if t <= self.now]:
            del looked_up[peer]
        for peer in self.lookup():
            q = self.peers.get(peer)
            if q is not None:
                looked_up[peer] = q.last_look + CLAIM_TTL

    def heard(self, p: Peer, peer: str) -> bool:
        """Whether ``p``'s view heard ``peer``'s last news (on a topic it was subscribed to when
        the news went out) and holds it still (unexpired)."""
        if self.heard_until.get(peer, 0.0) <= self.now:
            return False
        at, ranges = self.news_of.get(peer, (math.inf, ()))
        subs, paused = p.subs, p.paused
        return any((r in subs and subs[r] <= at) or (r in paused and paused[r][0] <= at <= paused[r][1])
                   for r in ranges)

    def view_claims(self, p: Peer, most: int | None = VIEW_DECIDE_MOST) -> tuple[list[Claim], int]:
        """The claims of ``p``'s view, not its own: what its lookups got, and the news it heard on
        its neighbourhood's topics; and how many it holds. Where either part holds more than
        ``most`` / 2, a random sample of that many stands for it, each sampled claim's tokens/s
        scaled by how many claims of the part it stands for (so a layer's planned tokens/s is the
        view's, in expectation), and the count is estimated from the sample."""
        now, claims = self.now, self.claims
        looked = [q for q, t in p.looked_up.items() if t > now and q in claims and q != p.id]
        in_lookups = set(looked)
        half = None if most is None else most // 2
        looked_weight = 1.0
        if half is not None and len(looked) > half:
            looked_weight = len(looked) / half
            looked = self.rng.sample(looked, half)
        view = [claims[q] for q in looked]
        if looked_weight != 1.0:
            view = [_scaled(c, looked_weight) for c in view]
        held = len(looked) * looked_weight
        # the news heard: candidates are the providers of the ranges it follows (or left for
        # being crowded: what it heard before stays until it expires)
        subs = list(p.subs) + list(p.paused)
        slots = sum(len(self.providers[r]) for r in subs)  # a peer providing under k of them: k slots
        if half is None or slots <= 8 * half:
            candidates = list(dict.fromkeys(q for r in subs for q in self.providers[r]))
            weight = 1.0
            if half is not None and len(candidates) > half:
                weight = len(candidates) / half
                candidates = self.rng.sample(candidates, half)
            drawn = [(q, weight) for q in candidates]
        else:
            # many: draw slots at random (with replacement; cheaper than listing the candidates),
            # each standing for slots / half of them, divided among a peer's k slots
            sizes = list(itertools.accumulate(len(self.providers[r]) for r in subs))
            members = [self.providers[r] for r in subs]
            drawn = []
            for _ in range(half):
                i = self.rng.randrange(slots)
                at = bisect.bisect_right(sizes, i)
                q = members[at].at(i - (sizes[at - 1] if at else 0))
                k = sum(1 for r in self._provider_ranges.get(q, ()) if r in subs) or 1
                drawn.append((q, slots / (half * k)))
        for q, weight in drawn:
            if q != p.id and q not in in_lookups and self.heard(p, q):
                c = claims[q]
                view.append(c if weight == 1.0 else _scaled(c, weight))
                held += weight
        return view, round(held)

    def lookup_claims(self, p: Peer) -> list[Claim]:
        """The claims one lookup of every range finds (not counted: the caller counts), not
        ``p``'s own; noted in its view."""
        picked: dict[str, None] = {}
        for members in self.providers:
            picked.update(dict.fromkeys(members.sample(self.rng, LOOKUP_PROVIDERS_PER_RANGE)))
        picked.pop(p.id, None)
        for q in picked:
            if q in self.peers:
                p.looked_up[q] = self.peers[q].last_look + CLAIM_TTL
        return [self.claims[q] for q in picked if q in self.claims]

    def measure_successors(self, p: Peer) -> None:
        """Round trips to the peers serving the layers after its own, reported in its claim:
        ``RTT_SAMPLES`` pings to each successor new to it or measured ``SUCCESSOR_RTT_MAX_AGE_S``
        ago or more (``ComputePeer.measure_successors``)."""
        if p.span is None:
            return
        nxt = [self.peers[q] for q in itertools.islice(self.by_start.get(p.span[1], ()), 32) if q in self.peers]
        stale = [q for q in nxt if self.now - p.rtt_measured.get(q.id, -math.inf) >= SUCCESSOR_RTT_MAX_AGE_S]
        p.rtt_measured = {q.id: self.now if q in stale else p.rtt_measured[q.id] for q in nxt}
        p.rtts = tuple((q.id, self.rtt(p, q)) for q in nxt[:MAX_RTTS])
        self.count("ping", RTT_SAMPLES * len(stale), RTT_SAMPLES * len(stale) * wire.PING)

    def random_claims(self, p: Peer, most: int) -> list[Claim]:
        """At most ``most`` random live claims but ``p``'s own."""
        picked = self.claim_ids.sample(self.rng, most + 1)
        return [self.claims[peer] for peer in picked if peer != p.id][:most]

    def every_claim(self, p: Peer) -> list[Claim]:
        """Every live claim but ``p``'s own (``shardnet+full-view``'s what-if)."""
        return [c for peer, c in self.claims.items() if peer != p.id]

    # -- placement -------------------------------------------------------------------------------
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


def _scaled(c: Claim, weight: float) -> Claim:
    """``c`` with its tokens/s times ``weight`` (``dataclasses.replace`` without re-checking
    the claim: 6x faster, and a simulated view's samples make many)."""
    scaled = object.__new__(Claim)
    scaled.__dict__.update(c.__dict__)
    object.__setattr__(scaled, "tput", c.tput * weight)
    return scaled


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

    def __iter__(self):
        return iter(self._items)

    def at(self, i: int) -> str:
        return self._items[i]


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
