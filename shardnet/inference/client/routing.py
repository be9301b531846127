"""Choosing a chain: the cheapest sequence of claims that covers every layer exactly once.

A shortest path over states (layer boundary, the peer that reached it): from the client at
boundary 0, a claim for layers [a, b) leads from any state at boundary a to (b, its peer), at
``cost(previous claim or None, claim)`` (the client's estimate: the round trip of that edge,
as the previous peer reported it or as the client measured it, plus the peer's compute time per
token, relayed links costing more); ``finish(last claim)`` adds the direct return to the client.
Dijkstra finds the cheapest complete chain; equal costs are broken at random, so clients spread
over equivalent peers.

``ChainCost`` is that estimate as a pure function of the claims and the client's round trips
(the route planner feeds it measured ones, the swarm simulator its world's). Given one,
``plan_route`` relaxes each boundary's claims at their own cost once, from the cheapest state
there, and later states only through the round trips their claim reported: exact, and linear in
the claims instead of quadratic per boundary (a route over 10,000 claims in milliseconds).

Chains may also enter and leave a span at any layer (issue 39): a claim that says ``sub_spans``
may serve part of its span, priced per layer (``narrowed``). Every hop goes forward in the layers,
so over such hops ``_LayerSweep`` needs no heap: one pass over the layer boundaries, vectorized
over the claims.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from shardnet.errors import NoRouteError
from shardnet.protocols.block_claim import Claim

HopCost = Callable[[Claim | None, Claim], float]

#: route cost of a hop whose round trip we could not measure (seconds)
UNKNOWN_RTT = 0.05
#: a relayed hop's round trip counts this many times (every byte crosses the relay twice)
RELAYED_RTT_FACTOR = 3.0
#: how much cheaper a peer already in the chain looks when a chain heals (keep what works)
KEEP_DISCOUNT = 0.25
#: route cost of a hop whose peer is there but did not answer a probe in time (seconds)
SLOW_RTT = 2.0
#: a full peer's compute counts 1 / LOAD_FLOOR times (see ``ChainCost``)
LOAD_FLOOR = 0.05


def link_rtt(measured: float | None, *, slow: bool = False, relayed: bool = False) -> float:
    """The round trip routing counts for a link: measured (else ``UNKNOWN_RTT``; ``SLOW_RTT``
    for a peer that did not answer in time), several times over when relayed."""
    rtt = SLOW_RTT if slow else (UNKNOWN_RTT if measured is None else measured)
    return rtt * RELAYED_RTT_FACTOR if relayed else rtt


def probe_order(peers: Iterable[str], probed_at: dict[str, float], most: int) -> list[str]:
    """Which ``most`` peers a route's probes measure: those never measured first (in the order
    given), then those measured longest ago. Taking the first ``most`` in the view's order, as
    before, left a client of a swarm larger than ``most`` peers guessing every other peer's
    round trip forever (bench/swarm_sim showed it)."""
    return sorted(dict.fromkeys(peers), key=lambda p: probed_at.get(p, float("-inf")))[:most]


def _one(peer: str) -> float:
    return 1.0


def _claimed_load(claim: Claim) -> float:
    return claim.load


def _claimed_tput(claim: Claim) -> float:
    return claim.tput


@dataclass(frozen=True)
class ChainCost:
    """Seconds per token a chain costs, as the client estimates it. ``rtt(peer)``: the client's
    round trip to a peer (``link_rtt``); ``factor(peer)``: a multiplier (reputation);
    ``kept``: peers of a chain being healed, which cost ``KEEP_DISCOUNT`` as much. A hop's
    compute is 1 / its tokens/s (``tput``: as its claim says by default; a client counts what it
    observed, see peer_speeds.py), more as its ``load`` nears full."""

    rtt: Callable[[str], float]
    factor: Callable[[str], float] = _one
    kept: frozenset[str] = frozenset()
    #: a peer's load as the client reckons it (default: as its claim says; see own_load.py)
    load: Callable[[Claim], float] = _claimed_load
    #: a peer's throughput as the client reckons it (default: as its claim says; see peer_speeds.py)
    tput: Callable[[Claim], float] = _claimed_tput

    def hop(self, prev: Claim | None, claim: Claim) -> float:
        """Reaching and crossing ``claim``'s hop: half the round trip from the previous hop (as
        that peer reported it; the client's as a stand-in) plus the peer's compute per token."""
        return self._hop(self._rtt_to(prev, claim), claim)

    def _rtt_to(self, prev: Claim | None, claim: Claim) -> float:
        """The round trip from the previous hop to ``claim``'s peer: as that peer reported it, else ours."""
        reported = dict(prev.rtts).get(claim.peer) if prev is not None else None
        return reported if reported is not None else self.rtt(claim.peer)

    def _hop(self, rtt: float, claim: Claim) -> float:
        return (rtt / 2 + self.compute(claim)) * self.factor(claim.peer)

    def compute(self, claim: Claim) -> float:
        """The peer's compute per token as routing counts it."""
        tput = self.tput(claim)
        compute = 1.0 / tput if tput > 0 else 0.0
        # A peer whose KV budget is mostly taken is as slow as its batches are big, and refuses
        # new sessions once it is full (they wait in line): its compute counts 1 / (1 - load)
        # times. Without this every gateway sent every request down its one cheapest chain until
        # that chain refused them (bench/swarm_sim: most sessions failed "busy" at half load).
        return compute / max(LOAD_FLOOR, 1.0 - self.load(claim))

    def discount(self, peer: str) -> float:
        """How much of its cost a hop through ``peer`` counts: less for a peer being kept."""
        return KEEP_DISCOUNT if peer in self.kept else 1.0

    def finish(self, last: Claim) -> float:
        """The last hop's result coming back to the client."""
        return self.rtt(last.peer) / 2

    def step(self, prev: Claim | None, claim: Claim) -> float:
        """``hop`` as routing weighs it (a kept peer discounted)."""
        return self.hop(prev, claim) * self.discount(claim.peer)

    def transport(self, route: list[Claim]) -> float:
        """The round trips' part of ``total(route)``: the halves each hop is reached by, and the
        return (no compute, no reputation)."""
        out = sum(self._rtt_to(prev, c) / 2 for prev, c in zip([None, *route], route))
        return out + (self.finish(route[-1]) if route else 0.0)

    def total(self, route: list[Claim]) -> float:
        """Estimated seconds per token through ``route``, the return included."""
        prev, out = None, 0.0
        for c in route:
            out += self.hop(prev, c)
            prev = c
        return out + (self.finish(route[-1]) if route else 0.0)


def plan_route(claims: Iterable[Claim], num_layers: int, *, cost: HopCost | ChainCost | None = None,
               finish: Callable[[Claim], float] | None = None, rng: random.Random | None = None,
               sub_spans: bool = False) -> list[Claim]:
    """The cheapest chain covering layers 0..num_layers-1 (default: 1 per hop, so fewest hops).
    ``cost``: a ``ChainCost`` (its ``finish`` too), or any function of (previous claim, claim).
    ``sub_spans``: a claim that says ``sub_spans`` may also be used for part of its span, from
    and to any *cut* inside it (a boundary where some usable claim starts or ends: ``narrowed``);
    such a hop comes back as the claim narrowed to the layers it runs (with a ``ChainCost``,
    ``_LayerSweep``; with any other cost, each narrowed claim priced by it, which grows with the
    square of the cuts: for tests and small swarms). Clients route this way (route_planner.py);
    bench/plan_routes.py times it against whole spans.

    Raises NoRouteError naming the layers nobody serves, or saying that the claims do not line up.
    """
    rng = rng or random.Random()
    usable = [c for c in claims if c.serving and 0 <= c.start < c.end <= num_layers]
    if sub_spans and any(c.sub_spans for c in usable):
        if isinstance(cost, ChainCost):
            rng.shuffle(usable)
            return _LayerSweep(usable, num_layers, cost).plan()
        usable = _with_sub_spans(usable)  # (any cost function: each narrowed claim priced by it)
    rng.shuffle(usable)  # among equal costs the first found wins: a random one
    by_start: dict[int, list[int]] = {}
    for i, c in enumerate(usable):
        by_start.setdefault(c.start, []).append(i)
    if isinstance(cost, ChainCost):
        weights: _Weights = _ChainWeights(usable, by_start, cost, num_layers)
    else:
        weights = _AnyWeights(usable, by_start, cost or (lambda prev, c: 1.0), finish or (lambda c: 0.0),
                              num_layers)
    # a state is (boundary, index of the claim that reached it); -1 is the client at boundary 0
    best: dict[tuple[int, int], float] = {(0, -1): 0.0}
    came_from: dict[tuple[int, int], tuple[int, int]] = {}
    tie = itertools.count()
    heap: list = [(0.0, next(tie), (0, -1))]
    done: set[tuple[int, int]] = set()
    goal: tuple[int, int] | None = None
    while heap:
        d, _, state = heapq.heappop(heap)
        if state in done:
            continue
        done.add(state)
        at, idx = state
        if at == num_layers and idx >= 0:
            goal = state
            break
        for i, w in weights.from_state(at, idx):
            nxt = (usable[i].end, i)
            if d + w < best.get(nxt, float("inf")):
                best[nxt], came_from[nxt] = d + w, state
                heapq.heappush(heap, (d + w, next(tie), nxt))
    if goal is None:
        raise NoRouteError(explain_gap(usable, num_layers))
    chain, state = [], goal
    while state[1] >= 0:
        chain.append(usable[state[1]])
        state = came_from[state]
    return chain[::-1]


def narrowed(claim: Claim, start: int, end: int) -> Claim:
    """``claim`` used for layers [start, end) of its span (a sub-span hop): its tokens/s scaled to
    the layers it runs (compute per token is per layer), and no span being loaded."""
    if not claim.start <= start < end <= claim.end:
        raise ValueError(f"layers {start}:{end} are not within the claim's {claim.start}:{claim.end}")
    if (start, end) == (claim.start, claim.end):
        return claim
    return replace(claim, start=start, end=end, tput=claim.tput * (claim.end - claim.start) / (end - start),
                   loading=None)


def _with_sub_spans(usable: list[Claim]) -> list[Claim]:
    """``usable`` and, for each claim that says ``sub_spans``, the claim narrowed to every range
    between two cuts inside its span (cuts: where a usable claim starts or ends; other
    boundaries never help a route, since a hop could only end where the next one starts). Where
    spans line up (a tiling) no claim has a cut inside and nothing is added; where every
    boundary is a cut, a claim of n layers adds up to n (n + 1) / 2 - 1."""
    cuts = sorted({c.start for c in usable} | {c.end for c in usable})
    out = list(usable)
    for c in usable:
        if not c.sub_spans:
            continue
        inside = cuts[bisect.bisect_left(cuts, c.start):bisect.bisect_right(cuts, c.end)]
        out.extend(narrowed(c, a, b) for i, a in enumerate(inside) for b in inside[i + 1:]
                   if (a, b) != (c.start, c.end))
    return out


class _LayerSweep:
    """``plan_route`` with a ``ChainCost`` where claims may be cut (``sub_spans``). Every hop goes
    forward in the layers, so the states form a DAG ordered by boundary and need no heap: one
    sweep over the boundaries, each step vectorized over the claims (numpy), computes

    - ``out[j]``: the cheapest chain whose last hop, in claim j, ends at this boundary (a
      ``sub_spans`` claim at any cut inside or at the end of its span, any other at its end);
    - ``enter[j]``: the cheapest chain whose next hop enters claim j here (a ``sub_spans`` claim at
      any cut inside its span, any other at its start): over every hop ending here, what it cost
      plus half the round trip to j's peer, as that hop's peer reported it, else the client's;
    - ``inside[j]`` at the next boundary: the cheapest chain with claim j's hop past this layer
      (entered here, or already inside), one layer's compute more (compute is per layer).

    Exact, as the heap-based search over the same states: each hop's cost is ``ChainCost``'s,
    and the round trip a hop pays depends on the previous hop only through what it reported, so
    an entry's cheapest source is the cheapest ending hop that did not report the entered peer
    (found among the few cheapest) or one that did. Time grows with the claims times the layers
    in numpy, not in Python (bench/plan_routes.py: 1.0-1.5x whole spans' planning time at 10,000
    claims, 2.1-2.6x at 1,000, where the fixed cost per boundary is most of it). A chain that
    enters one claim twice (A 0:1, B 1:2, A 2:3) comes back with that claim running everything
    from its first hop to its last (``_each_claim_once``): a peer holds one session per request."""

    #: how many of a boundary's cheapest ending hops are looked at for an entry the cheapest one
    #: cannot make (it is the entered claim, or reported a round trip to its peer); all of them
    #: when these do not do
    FEW = 4

    def __init__(self, usable: list[Claim], num_layers: int, cost: ChainCost) -> None:
        self.usable, self.L = usable, num_layers
        w = _ChainWeights(usable, {}, cost, num_layers)
        n = len(usable)
        self.start = np.fromiter((c.start for c in usable), np.int64, n)
        self.end = np.fromiter((c.end for c in usable), np.int64, n)
        self.cut = np.fromiter((c.sub_spans for c in usable), bool, n)
        fk = np.array(w.factor, dtype=np.float64) * np.array(w.keep, dtype=np.float64)
        compute = np.array(w.compute, dtype=np.float64)
        self.hop = compute * fk  # a whole span's compute
        self.per_layer = self.hop / (self.end - self.start)
        self.client_half = np.array(w.client_rtt, dtype=np.float64) / 2 * fk
        self.tail = np.array(w.tail, dtype=np.float64)
        self.is_cut = np.zeros(num_layers + 1, bool)
        self.is_cut[self.start] = True
        self.is_cut[self.end] = True
        # the round trips each claim's peer reported, as (source claim, entered claim, its half)
        self.by_peer: dict[str, list[int]] = {}
        for j, c in enumerate(usable):
            self.by_peer.setdefault(c.peer, []).append(j)
        # (flattened a claim at a time, joined to the entered claims in numpy: 80,000 round trips
        # one at a time in Python were most of a plan's time)
        peer_index = {peer: k for k, peer in enumerate(self.by_peer)}
        src: list[int] = []
        peers: list[str] = []
        rtts: list[float] = []
        for i, c in enumerate(usable):
            if c.rtts:
                reported = dict(c.rtts)
                src.extend([i] * len(reported))
                peers.extend(reported)
                rtts.extend(reported.values())
        to = np.fromiter((peer_index.get(p, -1) for p in peers), np.int64, len(peers))
        known = to >= 0
        src_a, to, rtt_a = np.array(src, dtype=np.int64)[known], to[known], np.array(rtts, dtype=np.float64)[known]
        # each reported peer's claims: claims sorted by peer, a run per peer
        claim_peer = np.fromiter((peer_index[c.peer] for c in usable), np.int64, n)
        by_peer_order = np.argsort(claim_peer, kind="stable")
        first = np.searchsorted(claim_peer[by_peer_order], to, side="left")
        count = np.searchsorted(claim_peer[by_peer_order], to, side="right") - first
        self.pair_src = np.repeat(src_a, count)
        self.pair_dst = by_peer_order[_runs(first, count)]
        pair_half = np.repeat(rtt_a, count) / 2 * fk[self.pair_dst]
        # the boundaries where each pair may be used (its source's hop can end there, its entered
        # claim be entered), a bucket per boundary: most pairs' spans do not meet and cost nothing
        ps, pd = self.pair_src, self.pair_dst
        lo = np.maximum(np.where(self.cut[ps], self.start[ps] + 1, self.end[ps]), self.start[pd])
        hi = np.minimum(self.end[ps], np.where(self.cut[pd], self.end[pd] - 1, self.start[pd]))
        length = np.clip(hi - lo + 1, 0, None) * (ps != pd)
        pair = np.repeat(np.arange(len(ps)), length)
        at = _runs(lo, length)
        order = np.argsort(at, kind="stable")
        pair, at = pair[order], at[order]
        self.bucket = np.searchsorted(at, np.arange(num_layers + 2))  # pairs usable at b: bucket[b]:bucket[b+1]
        self.bucket_src, self.bucket_dst, self.bucket_half = ps[pair], pd[pair], pair_half[pair]
        self._reports: dict[int, frozenset[int]] = {}

    def reports(self, i: int) -> frozenset[int]:
        """The claims whose peers claim i's peer reported a round trip to."""
        if i not in self._reports:
            self._reports[i] = frozenset(j for peer in dict(self.usable[i].rtts) for j in self.by_peer.get(peer, ()))
        return self._reports[i]

    def _entries(self, b: int, out: np.ndarray, enterable: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each claim's cheapest entry at boundary b (inf where none) and where it comes from (a
        claim whose hop ends at b; -1: the client, at boundary 0)."""
        n = len(self.usable)
        if b == 0:
            return np.where(enterable, self.client_half, np.inf), np.full(n, -1, np.int64)
        first = int(out.argmin())
        if not np.isfinite(out[first]):
            return np.full(n, np.inf), np.full(n, -1, np.int64)
        enter = np.where(enterable, out[first] + self.client_half, np.inf)
        source = np.full(n, first, np.int64)
        # the cheapest ending hop cannot enter its own claim, and pays its reported round trip to
        # the peers it reported: those take the cheapest other ending hop that reported nothing
        # on them (the reported round trips come next)
        awkward = [j for j in (first, *self.reports(first)) if enterable[j]]
        if awkward:
            ending = np.flatnonzero(np.isfinite(out))  # the hops ending here, cheapest first
            if len(ending) > self.FEW:
                few = ending[np.argpartition(out[ending], self.FEW)[:self.FEW]]
                few = few[np.argsort(out[few])].tolist()
            else:
                few = ending[np.argsort(out[ending])].tolist()
            every: list[int] | None = None  # all of them in order, sorted only if the few do not do
            for j in awkward:
                s = next((s for s in few if s != j and j not in self.reports(s)), None)
                if s is None and len(few) < len(ending):
                    if every is None:
                        every = ending[np.argsort(out[ending])].tolist()
                    s = next((s for s in every if s != j and j not in self.reports(s)), None)
                enter[j], source[j] = (out[s] + self.client_half[j], s) if s is not None else (np.inf, -1)
        # reported round trips, from every hop ending here
        lo, hi = self.bucket[b], self.bucket[b + 1]
        srcs, dsts, half = self.bucket_src[lo:hi], self.bucket_dst[lo:hi], self.bucket_half[lo:hi]
        cand = out[srcs] + half
        live = np.isfinite(cand) & enterable[dsts]
        if live.any():
            srcs, dsts, cand = srcs[live], dsts[live], cand[live]
            order = np.lexsort((cand, dsts))  # by entered claim, cheapest first
            dsts, cand, srcs = dsts[order], cand[order], srcs[order]
            firsts = np.flatnonzero(np.diff(dsts, prepend=-1))
            d, c, s = dsts[firsts], cand[firsts], srcs[firsts]
            better = c < enter[d]
            enter[d[better]], source[d[better]] = c[better], s[better]
        return enter, source

    def plan(self) -> list[Claim]:
        return [narrowed(self.usable[j], a, e) for j, a, e in _each_claim_once(self.cheapest_hops())]

    def cheapest_hops(self) -> list[tuple[int, int, int]]:
        """The cheapest chain as (claim index, first layer, end) per hop, a claim possibly twice."""
        L, n = self.L, len(self.usable)
        inf = np.inf
        # which claims' hops may end, be entered or go on at each boundary: rows of (L + 1, n)
        bs = np.arange(L + 1)[:, None]
        start, end, cut, at_cut = self.start[None], self.end[None], self.cut[None], self.is_cut[:, None]
        may_end = cut & (start < bs) & (bs <= end) & at_cut
        covers = cut & (start <= bs) & (bs < end)
        may_enter = (covers & at_cut) | (~cut & (start == bs))
        whole_ending = [np.flatnonzero(row) for row in ~cut & (end == bs)]
        whole_starting = [np.flatnonzero(row) for row in ~cut & (start == bs)]
        inside = np.full(n, inf)  # the cheapest chain with each claim's hop running up to this boundary
        whole = np.full(n, inf)  # a whole-span hop entered at its start: its chain's cost at its end
        whole_source = np.full(n, -1, np.int64)
        entered_at: list[np.ndarray] = []  # per boundary: where each claim's hop entered (or not) there
        source_at: list[np.ndarray] = []
        nothing, nobody = np.zeros(n, bool), np.full(n, -1, np.int64)
        for b in range(L + 1):
            out = np.where(may_end[b], inside, inf)
            ending = whole_ending[b]
            out[ending] = whole[ending]
            if b == L:
                break
            if not self.is_cut[b]:  # no hop ends or starts here: those inside go on
                entered_at.append(nothing)
                source_at.append(nobody)
                inside = np.where(covers[b], inside + self.per_layer, inf)
                continue
            enter, source = self._entries(b, out, may_enter[b])
            entered_at.append(enter < inside)  # (inside is inf where the hop cannot go on)
            source_at.append(source)
            inside = np.where(covers[b], np.minimum(enter, inside) + self.per_layer, inf)
            starting = whole_starting[b]
            whole[starting] = enter[starting] + self.hop[starting]
            whole_source[starting] = source[starting]
        total = out + np.where(self.end == L, self.tail, inf)
        last = int(total.argmin()) if n else -1
        if last < 0 or not np.isfinite(total[last]):
            raise NoRouteError(explain_gap(self.usable, L))
        hops, j, b = [], last, L  # (claim, first layer, end), from the last hop back
        while j >= 0:
            c = self.usable[j]
            if not c.sub_spans:
                hops.append((j, c.start, c.end))
                j, b = int(whole_source[j]), c.start
                continue
            e = b
            b -= 1
            while not entered_at[b][j]:
                b -= 1
            hops.append((j, b, e))
            j = int(source_at[b][j])
        return hops[::-1]


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``starts[k], starts[k] + 1, ..`` (``lengths[k]`` of them) for each k, one after another."""
    return np.repeat(starts, lengths) + np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _each_claim_once(hops: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``hops`` (claim, first layer, end) with a claim the chain enters twice (cut at both ends
    of a cheaper hop elsewhere: A 0:1, B 1:2, A 2:3) running everything from its first hop to its
    last as one: a peer holds one session per request. That chain may cost a little more than
    the one found; it is one the peers can run."""
    for i, (j, a, _) in enumerate(hops):
        last = max(k for k, hop in enumerate(hops) if hop[0] == j)
        if last > i:
            return _each_claim_once(hops[:i] + [(j, a, hops[last][2])] + hops[last + 1:])
    return hops


class _Weights:
    """The hops worth relaxing from a state of ``plan_route``, with their weights (the return to
    the client included for a hop that ends the chain)."""

    def from_state(self, at: int, idx: int) -> Iterable[tuple[int, float]]:
        raise NotImplementedError


class _AnyWeights(_Weights):
    """Any cost function: every claim starting at the boundary, from every state there."""

    def __init__(self, usable: list[Claim], by_start: dict[int, list[int]], cost: HopCost,
                 finish: Callable[[Claim], float], num_layers: int) -> None:
        self.usable, self.by_start, self.cost, self.finish, self.num_layers = usable, by_start, cost, finish, num_layers

    def from_state(self, at: int, idx: int) -> Iterable[tuple[int, float]]:
        prev = self.usable[idx] if idx >= 0 else None
        for i in self.by_start.get(at, ()):
            c = self.usable[i]
            w = float(self.cost(prev, c)) + (float(self.finish(c)) if c.end == self.num_layers else 0.0)
            if w < 0:
                raise ValueError(f"route cost must not be negative (got {w} for {c.peer})")
            yield i, w


class _ChainWeights(_Weights):
    """A ``ChainCost``'s weights, exact and fast. A hop costs the same from every state at a
    boundary unless the previous claim reported its round trip; states are popped cheapest
    first, so once a claim was relaxed at its unreported cost no later state can do better that
    way: only the claims the previous hop reported on, and those never yet relaxed unreported,
    remain. What a hop costs apart from its round trip (``ChainCost.compute``, ``factor``,
    ``discount``, ``finish``) is worked out once per claim and combined in the order
    ``ChainCost.step`` combines it (the same floats)."""

    def __init__(self, usable: list[Claim], by_start: dict[int, list[int]], cost: ChainCost, num_layers: int) -> None:
        self.usable, self.by_start = usable, by_start
        self.compute, self.factor, self.keep, self.client_rtt, self.tail = [], [], [], [], []
        rtt_of: dict[str, float] = {}  # a peer may hold several claims: one round trip each
        for c in usable:
            self.compute.append(cost.compute(c))
            self.factor.append(cost.factor(c.peer))
            self.keep.append(cost.discount(c.peer))
            if c.peer not in rtt_of:
                rtt_of[c.peer] = cost.rtt(c.peer)
            self.client_rtt.append(rtt_of[c.peer])
            self.tail.append(cost.finish(c) if c.end == num_layers else 0.0)
        self._by_peer: dict[int, dict[str, list[int]]] = {}
        self._unrelaxed: dict[int, dict[int, None]] = {}

    def _weight(self, i: int, rtt: float) -> float:
        return (rtt / 2 + self.compute[i]) * self.factor[i] * self.keep[i] + self.tail[i]

    def from_state(self, at: int, idx: int) -> Iterable[tuple[int, float]]:
        return [(i, self._weight(i, rtt)) for i, rtt in self.entries(at, idx)]

    def entries(self, at: int, idx: int) -> list[tuple[int, float]]:
        """The claims to relax from a state at ``at`` reached by claim ``idx`` (-1: the client),
        each with the round trip its hop pays (reported by ``idx``'s peer, else the client's)."""
        everything = self.by_start.get(at, ())
        if idx < 0:
            return [(i, self.client_rtt[i]) for i in everything]
        if at not in self._by_peer:
            by_peer: dict[str, list[int]] = {}
            for i in everything:
                by_peer.setdefault(self.usable[i].peer, []).append(i)
            self._by_peer[at], self._unrelaxed[at] = by_peer, dict.fromkeys(everything)
        reported = dict(self.usable[idx].rtts)
        by_peer, unrelaxed = self._by_peer[at], self._unrelaxed[at]
        out = [(i, rtt) for peer, rtt in reported.items() for i in by_peer.get(peer, ())]
        for i in [i for i in unrelaxed if self.usable[i].peer not in reported]:
            del unrelaxed[i]
            out.append((i, self.client_rtt[i]))
        return out


def uncovered_layers(claims: Iterable[Claim], num_layers: int) -> list[int]:
    covered = set()
    for c in claims:
        if c.serving:
            covered.update(range(max(c.start, 0), min(c.end, num_layers)))
    return [layer for layer in range(num_layers) if layer not in covered]


def format_layers(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def explain_gap(claims: list[Claim], num_layers: int) -> str:
    missing = uncovered_layers(claims, num_layers)
    spans = sorted({(c.start, c.end) for c in claims})
    if missing:
        return (f"no live peer serves layer{'s' if len(missing) > 1 else ''} {format_layers(missing)} "
                f"(model has {num_layers} layers; served spans: {spans})")
    return f"every layer is served, but no chain of spans lines up end to end (served spans: {spans})"
