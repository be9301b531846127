"""Placement policies compared by the simulator.

- ``shardnet``: the project's own rules, called as a compute peer calls them
  (``shardnet.inference.server.placement``: ``best_window`` on joining, ``plan_move`` and
  ``fillable_gap`` at each upkeep, ``upkeep_step`` and ``move_turn_delay`` for timing), over
  what a peer sees: on joining, the claims one lookup of every layer range finds (at most
  ``LOOKUP_PROVIDERS_PER_RANGE`` providers a range); at upkeep, its claims view
  (``Swarm.view_claims``: the news heard on the topics of its span's neighbourhood and what its
  lookups of every range, every ``UPKEEP_LOOKUP_S``, got; when it holds more than
  ``VIEW_DECIDE_MOST``, random samples that stand for the rest, to keep 10,000 peers to
  minutes), pinging at
  most ``UPKEEP_PINGS`` of its unconnected peers. With ``full_view`` (``shardnet+full-view``,
  a what-if) it decides from every claim instead; with ``providers`` (``shardnet-before``) from
  that many random claims, as one lookup of the model-wide provider key found them before.
- ``least-served``: Petals' rule (petals/server/block_selection.py): a joining server takes the
  window whose sorted throughputs are least (the lowest start among equals), sees every server
  (those joining too), and every ``PETALS_CHECK_S`` (about) moves if moving would raise the
  swarm's throughput by 1 / ``PETALS_BALANCE_QUALITY``. (Petals also simulates the other
  servers' moves before deciding; this is the single-move form.)
- ``water-filling``: a central scheduler that knows every peer, loading ones too: each joiner is
  poured into the neediest window at once, and every ``CENTRAL_PERIOD_S`` the whole swarm is
  poured again from scratch (largest peers first) and applied when it raises the bottleneck by
  ``CENTRAL_GAIN``. No peer can do this in a swarm without a centre; it is the yardstick.
"""

from __future__ import annotations

from bench.swarm_sim.swarm import VIEW_DECIDE_MOST, Policy
from shardnet.inference.server.placement import (
    DEFAULT_REBALANCE_INTERVAL,
    REBALANCE_MARGIN,
    UPKEEP_JITTER,
    best_window,
    fillable_gap,
    move_turn_delay,
    plan_move,
    planned_throughput,
    upkeep_step,
)

PETALS_CHECK_S = 120.0
PETALS_BALANCE_QUALITY = 0.75
CENTRAL_PERIOD_S = 600.0
CENTRAL_GAIN = 0.10


class Shardnet(Policy):
    name = "shardnet"
    claims_view = True

    def __init__(self, *, full_view: bool = False, view_most: int | None = VIEW_DECIDE_MOST,
                 providers: int | None = None, follow_edges: bool = False, follow_crowded: bool = False) -> None:
        self.full_view = full_view
        #: what if a compute peer's view kept following a crowded range's topic, as it did before
        #: ``claims_view.CROWDED_NEWS`` (``Swarm._crowd_out``)
        self.follow_crowded = follow_crowded
        #: what if a compute peer's view followed only the range of its span's first layer and
        #: that of the layer after its span, not every range its span covers (``Swarm.subscribe``)
        self.follow_edges = follow_edges
        #: the most claims of its view a peer plans over (None: all; Swarm.view_claims)
        self.view_most = view_most
        #: decide from this many random claims instead, as ``find_claims`` of one model-wide
        #: provider key returned them before dissemination 2 (``shardnet-before``)
        self.providers = providers

    def decide_from(self, swarm, peer, view):
        if self.full_view:
            return swarm.every_claim(peer)
        if self.providers is not None:
            return swarm.random_claims(peer, self.providers)
        return view

    def choose(self, swarm, peer):
        # the join's lookups are counted by the swarm (Swarm.join)
        if self.full_view or self.providers is not None:
            claims = self.decide_from(swarm, peer, None)
        else:
            claims = swarm.lookup_claims(peer)
        return best_window(planned_throughput(claims, swarm.model.num_layers), peer.n_layers, rng=swarm.rng)

    def view(self, swarm, peer):
        """The claims upkeep plans over, the liveness check counted."""
        claims, held = swarm.view_claims(peer, self.view_most)
        swarm.count_liveness(peer, held)
        swarm.stats.view_claims.append(held)
        return self.decide_from(swarm, peer, claims)

    def upkeep(self, swarm, peer):
        if peer.span is None:
            return None
        claims = self.view(swarm, peer)
        me = swarm.claim_of(peer)
        gap = fillable_gap(claims, *peer.span, swarm.model.num_layers)
        settling = swarm.now < peer.settle_until
        step = upkeep_step(DEFAULT_REBALANCE_INTERVAL, gap=gap, settling=settling)
        if not peer.moving:
            move = plan_move(claims, me, swarm.model.num_layers, margin=REBALANCE_MARGIN, rng=swarm.rng)
            if move is not None:
                if self.claims_view:
                    swarm.look_up_into(peer.looked_up)  # compute_peer looks the claims up before its turn
                same = sorted({c.peer for c in claims if (c.start, c.end) == peer.span} | {peer.id})
                delay = move_turn_delay(same.index(peer.id), step, swarm.rng)
                swarm.clock.later(delay, lambda: self._confirm(swarm, peer))
        return step * swarm.rng.uniform(*UPKEEP_JITTER)

    def _confirm(self, swarm, peer):
        if peer.gone or peer.moving or peer.span is None:
            return
        claims = self.view(swarm, peer)
        move = plan_move(claims, swarm.claim_of(peer), swarm.model.num_layers, margin=REBALANCE_MARGIN,
                         rng=swarm.rng)
        if move is not None:
            swarm.move(peer, (move.start, move.end))


class LeastServed(Policy):
    name = "least-served"

    def choose(self, swarm, peer):
        # Petals sees every server, and counts those still joining where they are going (its
        # JOINING state) at the throughput they announce
        return _petals_start(swarm.planned_served(without=peer), peer.n_layers)

    def upkeep(self, swarm, peer):
        if peer.span is not None and not peer.moving:
            others = swarm.planned_served(without=peer)
            swarm.count_lookup(peer)
            start, end = peer.span
            now = min(_plus(others, start, end, peer.tput))
            new = _petals_start(others, end - start)
            after = min(_plus(others, *new, peer.tput))
            if new != peer.span and (now <= 0 < after or now < PETALS_BALANCE_QUALITY * after):
                if all(others[i] > 0 for i in range(start, end)):
                    swarm.move(peer, new)
        return PETALS_CHECK_S * swarm.rng.uniform(0.5, 1.5)


def _petals_start(served: list[float], n: int) -> tuple[int, int]:
    n = max(1, min(n, len(served)))
    s = min(range(len(served) - n + 1), key=lambda i: (sorted(served[i:i + n]), i))
    return s, s + n


def _plus(served: list[float], start: int, end: int, tput: float) -> list[float]:
    return [x + tput if start <= i < end else x for i, x in enumerate(served)]


class WaterFilling(Policy):
    name = "water-filling"
    decentralized = False

    def __init__(self) -> None:
        self.next_pour = CENTRAL_PERIOD_S

    def choose(self, swarm, peer):
        return best_window(swarm.planned_served(without=peer), peer.n_layers, rng=swarm.rng)

    def tick(self, swarm):
        if swarm.now < self.next_pour:
            return
        self.next_pour = swarm.now + CENTRAL_PERIOD_S
        peers = sorted((p for p in swarm.peers.values() if p.span is not None),
                       key=lambda p: -p.tput * p.n_layers)
        served = [0.0] * swarm.model.num_layers
        plan = {}
        for p in peers:
            s, e = best_window(served, p.n_layers, rng=swarm.rng)
            plan[p.id] = (s, e)
            for i in range(s, e):
                served[i] += p.tput_at(s, e)
        if min(served) > min(swarm.planned_served()) * (1 + CENTRAL_GAIN):
            for p in peers:
                if plan[p.id] != p.target:
                    swarm.move(p, plan[p.id])


POLICIES = {p.name: p for p in (Shardnet, LeastServed, WaterFilling)}


def make(name: str) -> Policy:
    return POLICIES[name]()

