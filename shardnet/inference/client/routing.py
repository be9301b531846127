"""Choosing a chain: the cheapest sequence of claims that covers every layer exactly once.

A shortest path over states (layer boundary, the peer that reached it): from the client at
boundary 0, a claim for layers [a, b) leads from any state at boundary a to (b, its peer), at
``cost(previous claim or None, claim)`` (the client's estimate: the round trip of that edge,
as the previous peer reported it or as the client measured it, plus the peer's compute time per
token, relayed links costing more); ``finish(last claim)`` adds the direct return to the client.
Dijkstra finds the cheapest complete chain; equal costs are broken at random, so clients spread
over equivalent peers.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterable

from shardnet.errors import NoRouteError
from shardnet.protocols.block_claim import Claim

HopCost = Callable[[Claim | None, Claim], float]


def plan_route(claims: Iterable[Claim], num_layers: int, *, cost: HopCost | None = None,
               finish: Callable[[Claim], float] | None = None, rng: random.Random | None = None) -> list[Claim]:
    """The cheapest chain covering layers 0..num_layers-1 (default: 1 per hop, so fewest hops).

    Raises NoRouteError naming the layers nobody serves, or saying that the claims do not line up.
    """
    rng = rng or random.Random()
    usable = [c for c in claims if 0 <= c.start < c.end <= num_layers]
    rng.shuffle(usable)  # among equal costs the first found wins: a random one
    by_start: dict[int, list[tuple[int, Claim]]] = {}
    for i, c in enumerate(usable):
        by_start.setdefault(c.start, []).append((i, c))
    weight = cost or (lambda prev, c: 1.0)
    tail = finish or (lambda c: 0.0)
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
        prev = usable[idx] if idx >= 0 else None
        for i, c in by_start.get(at, ()):
            w = float(weight(prev, c)) + (float(tail(c)) if c.end == num_layers else 0.0)
            if w < 0:
                raise ValueError(f"route cost must not be negative (got {w} for {c.peer})")
            nxt = (c.end, i)
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


def uncovered_layers(claims: Iterable[Claim], num_layers: int) -> list[int]:
    covered = set()
    for c in claims:
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
