"""How fast this client saw each peer compute, against what the peer claims (its ``tput``).

A claim's throughput is the peer's own word, measured by itself: a peer announcing a fake one
drew every route (and every user's activations) before routing checked it. Routing now counts a
claim's throughput as follows (``PeerSpeeds.routing_tput``):

- a peer this client never observed counts at most as the typical peer of its layers
  (``typical_tput``: the median claim, per layer, of the other peers serving them): announcing
  1000x wins no first route, it ties with the typical peer at best;
- an observed peer counts at most as fast as it was seen to be (its claim capped by its observed
  speed, in the units claims use);
- a peer whose claim overstates its observed speed ``OVERCLAIM_FACTOR`` times more than the
  typical observed peer's claim does is *overclaiming*: it counts as the typical peer again and
  reputation.py makes its hops cost more, until later observations agree with its claim.

What is observed is a chain's time per decoded token (plain decoding, one step in flight), from
sending it to its result coming back. A client sees the whole chain, not its hops, so a step's
time is split among the route's round trips (as routing estimates them) and its hops' compute,
in proportion to their estimates; a hop's compute estimate is its claim, but never less than its
layers' typical peer would need divided by ``BELIEVABLE_SPREAD`` (a claim of 1000x the typical
speed is charged as if it were that spread at most, so the step's time lands on it). The split
makes every part of a step as much slower than estimated as the step was: what marks one peer is
that its claim is far from the others'. Each peer keeps an EWMA of its share, in seconds per
layer-token, and of how many times slower than its claim that was (``overstatement``). The
client's own overhead and its round-trip estimates make every claim look overstated by some
common factor; the median overstatement of the peers observed (``calibration``) stands for it.

Limits (docs/security.md): a step's time cannot be attributed to hops exactly, so a peer slower
than claimed shares the blame with its chain-mates (an honest peer marked so recovers once seen
in other chains), and a peer claiming up to about ``BELIEVABLE_SPREAD`` times its layers' typical
speed cannot be told from a truly faster one. Observations are this client's own, not shared.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shardnet.protocols.block_claim import Claim

#: a claim counts in a step's split as at most this many times its layers' typical speed
BELIEVABLE_SPREAD = 4.0
#: overclaiming: a claim overstating its observed speed this many times more than the median does
OVERCLAIM_FACTOR = 3.0
#: weight of the newest observation in a peer's moving averages
EWMA_WEIGHT = 0.3
#: a peer not observed for this long is forgotten (a peer routed around is observed no more:
#: one marked for a chain-mate's slowness, or slow for a while, is given its chance again)
FORGET_S = 600.0


def _layers(c: Claim) -> int:
    return max(1, c.end - c.start)


def typical_tput(claims: Iterable[Claim]) -> Callable[[Claim], float]:
    """Per claim: the throughput the typical other peer of its layers claims, for a span as long
    as its own. Per layer, the median (the lower middle one) of the other serving claims'
    layer-tokens per second (``tput`` times span length) covering it; over a claim's layers, the
    least of those. A claim with no other claim on its layers keeps its own figure."""
    by_layer: dict[int, list[float]] = {}
    for c in claims:
        if c.serving and c.tput > 0:
            for layer in range(c.start, c.end):
                by_layer.setdefault(layer, []).append(c.tput * _layers(c))
    for rates in by_layer.values():
        rates.sort()

    def others_median(rates: list[float], own: float | None) -> float:
        if own is None or len(rates) < 2:
            return rates[(len(rates) - 1) // 2]
        mine = bisect.bisect_left(rates, own)  # (its own rate is there when it is a serving claim)
        if mine == len(rates) or rates[mine] != own:
            return rates[(len(rates) - 1) // 2]
        middle = (len(rates) - 2) // 2  # the lower middle one of the others
        return rates[middle] if middle < mine else rates[middle + 1]

    def prior(c: Claim) -> float:
        own = c.tput * _layers(c) if c.serving and c.tput > 0 else None
        rates = [others_median(by_layer[layer], own) for layer in range(c.start, c.end) if layer in by_layer]
        return min(rates) / _layers(c) if rates else c.tput

    return prior


@dataclass
class Observed:
    """One peer as this client saw it (moving averages)."""

    seconds_per_layer: float  # its share of observed steps, per token and layer
    overstatement: float  # how many times its claimed throughput exceeded that observed
    at: float  # when last observed (the clock of ``PeerSpeeds``)
    steps: int = 1


class PeerSpeeds:
    """This client's observations of its peers' speeds (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._peers: dict[str, Observed] = {}

    @property
    def peers(self) -> dict[str, Observed]:
        """The peers observed within ``FORGET_S``."""
        since = self.clock() - FORGET_S
        for peer in [p for p, o in self._peers.items() if o.at < since]:
            del self._peers[peer]
        return self._peers

    def calibration(self) -> float:
        """The median overstatement among the peers observed (1 with none): how much this
        client's view of the chain (its overhead, its round-trip estimates) makes any claim look
        overstated."""
        seen = [o.overstatement for o in self.peers.values()]
        return statistics.median_low(seen) if seen else 1.0

    def overclaims(self) -> dict[str, float | None]:
        """Per peer observed: how many times more than the median its claim was overstated, when
        that is over ``OVERCLAIM_FACTOR`` (else None)."""
        k = self.calibration()
        return {peer: self._overclaim(o, k) for peer, o in self.peers.items()}

    @staticmethod
    def _overclaim(o: Observed, calibration: float) -> float | None:
        ratio = o.overstatement / calibration
        return ratio if ratio > OVERCLAIM_FACTOR else None

    def routing_tput(self, prior: Callable[[Claim], float]) -> Callable[[Claim], float]:
        """The throughput routing counts for a claim; ``prior``: its layers' typical throughput
        among the claims it competes with (``typical_tput``)."""
        k, peers = self.calibration(), self.peers

        def tput(c: Claim) -> float:
            claimed = c.tput if c.tput > 0 else prior(c)  # no figure: as the typical peer
            o = peers.get(c.peer)
            if o is None or self._overclaim(o, k) is not None:
                return min(claimed, prior(c))
            # as fast as it was seen to be, in the units claims use
            return min(claimed, k / (o.seconds_per_layer * _layers(c)))

        return tput

    def observe(self, route: list[Claim], seconds: float, transport: float,
                prior: Callable[[Claim], float]) -> None:
        """One step of one token through ``route`` took ``seconds``; routing estimates its round
        trips at ``transport`` seconds; ``prior``: as for ``routing_tput``."""
        route = [c for c in route if c.tput > 0]  # (one claiming no figure is charged nothing)
        if seconds <= 0 or not route:
            return
        compute = [1.0 / min(c.tput, BELIEVABLE_SPREAD * prior(c)) for c in route]
        scale = seconds / (max(transport, 0.0) + sum(compute))  # how much slower than estimated it was
        now, peers = self.clock(), self.peers
        for c, estimate in zip(route, compute):
            share = estimate * scale
            per_layer, overstated = share / _layers(c), share * c.tput
            o = peers.get(c.peer)
            if o is None:
                peers[c.peer] = Observed(per_layer, overstated, now)
            else:
                o.seconds_per_layer += EWMA_WEIGHT * (per_layer - o.seconds_per_layer)
                o.overstatement += EWMA_WEIGHT * (overstated - o.overstatement)
                o.at, o.steps = now, o.steps + 1
