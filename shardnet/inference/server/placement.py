"""Which layers a compute peer serves: how many it can hold, which window the swarm needs most,
and when moving helps (sans-IO: plain functions of the live claims).

The swarm's throughput is its bottleneck: the least-served layer, where a layer's served
throughput is the sum of the tokens/s claimed by the peers serving it. A joining peer takes the
window of layers whose served-throughput vector is smallest (compared sorted, so a window with
an unserved layer beats one without, then the one whose weakest layers are weakest); a serving
peer moves when the window it would take now, without itself, raises the bottleneck by a margin
(or, while layers are unserved, leaves fewer of them unserved), and only when every layer it
leaves is still served by someone else who stays.

Peers that choose at the same moment see the same claims (or none of each other's): a joining
peer takes, of the windows as needy as the neediest (on an empty swarm, a tiling of the model),
the one a hash of its peer ID names (``spread_window``), so that a wave of joins spreads over
them instead of all taking the same one.

Peers are counted where they will be: a claim names the span its peer is loading (``loading``),
so that peers choosing while another loads (minutes, on a home line) choose around it.
bench/swarm_sim drives these functions over thousands of simulated peers (docs/scale.md).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass

from shardnet.protocols.block_claim import Claim
from shardnet.transport.errors import ShardnetError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: share of the free memory a peer plans to use for weights (the rest: KV, activations, Python)
MEMORY_USE = 0.8
#: Seconds between looks at the swarm while a layer is unserved, and for SETTLE_S after a peer
#: (re)loaded a span chosen by itself: peers that chose at the same moment saw the same claims
#: and may have taken the same window, which the next look undoes within seconds.
FAST_INTERVAL = 2.0
#: seconds between a serving peer's looks at the swarm (``join --rebalance-interval``)
DEFAULT_REBALANCE_INTERVAL = 60.0
#: a move must raise the swarm's bottleneck by this share
REBALANCE_MARGIN = 0.2
SETTLE_S = 30.0


def layer_bytes(ckpt, layer: int, dtype: str, quantize: str | None = None) -> int:
    """Bytes the weights of one layer take once loaded in ``dtype``: every tensor the checkpoint
    stores for it (all of a mixture-of-experts layer's experts, shared experts and router
    included), a stored low-bit format's parts at their stored size (formats.held_bytes); with
    ``quantize``, its matrices at what that mode costs a parameter."""
    from shardnet.inference.model.formats import held_bytes
    from shardnet.inference.model.quantize import MIN_QUANTIZED_OUT, bytes_per_param

    size = DTYPE_BYTES[dtype]
    total = 0.0
    for name in ckpt.layer_tensors(layer):
        info = ckpt.catalog[name]
        shape = info.shape
        n = 1
        for d in shape:
            n *= d
        # what quantize_module quantizes: matrices of linear layers and experts, not norms,
        # biases or narrow routers
        if quantize and ckpt.quant is not None and name.endswith(ckpt.quant.module.COMPANION_SUFFIXES):
            continue  # (quantized anew from the dequantized weight: its stored scales are not kept)
        if quantize and len(shape) == 2 and name.endswith(".weight") and shape[0] >= MIN_QUANTIZED_OUT:
            total += n * bytes_per_param(quantize, size, in_features=shape[1], expert=".experts." in name)
        elif quantize and len(shape) == 3 and ".experts." in name and held_bytes(ckpt.quant, name, info, size) \
                == n * size:
            # an expert bank ([experts, ...] in the compute dtype): quantized as a bank (IntGroups);
            # which of its two widths is the input (transposed or not) is not known here: the
            # narrower, whose groups cost more
            total += n * bytes_per_param(quantize, size, in_features=min(shape[1:]), expert=True)
        else:
            total += held_bytes(ckpt.quant, name, info, size)
    return int(total)


def affordable_layers(ckpt, dtype: str, free_bytes: int, *, reserve_bytes: int = 0,
                      max_layers: int | None = None, quantize: str | None = None) -> int:
    """How many consecutive layers fit in ``free_bytes`` (after ``reserve_bytes`` for the KV
    cache) wherever the window falls: layers differ in size (dense first layers, then experts),
    so it is the largest n whose heaviest n-layer window fits."""
    sizes = [layer_bytes(ckpt, i, dtype, quantize) for i in range(ckpt.num_layers)]
    budget = int(free_bytes * MEMORY_USE) - reserve_bytes
    n = layers_fitting(sizes, budget, max_layers=max_layers)
    if n < 1:
        raise ShardnetError(f"not enough memory for one layer: up to {max(sizes) / 2**20:.0f} MiB each in {dtype}, "
                            f"{max(budget, 0) / 2**20:.0f} MiB to spend of {free_bytes / 2**20:.0f} MiB free")
    return n


def layers_fitting(sizes: list[int], budget: int, *, max_layers: int | None = None) -> int:
    """The largest n whose heaviest window of n consecutive layers (of ``sizes`` bytes each)
    fits in ``budget`` bytes (0 when not even one layer does)."""
    limit = len(sizes) if max_layers is None else min(len(sizes), max_layers)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    n = 0
    while n < limit and max(prefix[s + n + 1] - prefix[s] for s in range(len(sizes) - n)) <= budget:
        n += 1
    return n


def served_throughput(claims: Iterable[Claim], num_layers: int) -> list[float]:
    """Per layer, the tokens/s claimed by the peers serving it now."""
    served = [0.0] * num_layers
    for c in claims:
        if c.serving:
            _add(served, c.start, c.end, max(c.tput, 0.0))
    return served


def planned_throughput(claims: Iterable[Claim], num_layers: int) -> list[float]:
    """Per layer, the tokens/s of the peers that will serve it: each claim at the span it is
    loading if any, else the one it serves. A peer that serves nothing yet has measured nothing
    yet, and counts as the mean of those that have (any positive number keeps its layers from
    looking unserved; the mean keeps it from looking like more than one peer)."""
    claims = list(claims)
    guess = unmeasured_tput(claims)
    planned = [0.0] * num_layers
    for c in claims:
        start, end = c.loading or (c.start, c.end)
        _add(planned, start, end, max(c.tput, 0.0) if c.serving else guess)
    return planned


def unmeasured_tput(claims: list[Claim]) -> float:
    """What a peer that has measured nothing yet counts as: the mean of those that have (1.0 if none)."""
    measured = [c.tput for c in claims if c.serving and c.tput > 0]
    return sum(measured) / len(measured) if measured else 1.0


def staying_throughput(claims: Iterable[Claim], num_layers: int) -> list[float]:
    """Per layer, the tokens/s of the peers serving it now and not moving off it."""
    staying = [0.0] * num_layers
    for c in claims:
        if c.serving:
            lo, hi = c.loading or (c.start, c.end)
            _add(staying, max(c.start, lo), min(c.end, hi), max(c.tput, 0.0))
    return staying


def _add(served: list[float], start: int, end: int, tput: float) -> None:
    for layer in range(max(start, 0), min(end, len(served))):
        served[layer] += tput


def best_window(served: list[float], n: int, *, rng: random.Random | None = None) -> tuple[int, int]:
    """The start..end of the ``n`` consecutive layers the swarm needs most.

    Among equally needy windows, one flush with the model's ends or with better-served
    neighbours (so spans pack without leaving gaps too narrow for the next peer), then at random
    (so peers joining at once tend to spread)."""
    n = max(1, min(n, len(served)))
    s = (rng or random).choice(_neediest_starts(served, n))
    return s, s + n


def _neediest_starts(served: list[float], n: int) -> list[int]:
    """The starts of the neediest ``n``-layer windows, the ones that pack (see best_window) if any."""
    keys = {s: sorted(served[s:s + n]) for s in range(len(served) - n + 1)}
    best = min(keys.values())
    starts = [s for s, k in keys.items() if k == best]

    def flush(s: int) -> bool:
        left = s == 0 or served[s - 1] > served[s]
        right = s + n == len(served) or served[s + n] > served[s + n - 1]
        return left or right

    return [s for s in starts if flush(s)] or starts


def window_fills(planned: list[float], n: int, *, tput: float = 1.0) -> list[tuple[int, int]]:
    """The windows as needy as the neediest: those that peers of ``tput`` tokens/s each would take
    joining one after another (each the neediest given the ones before; ties to the first that
    packs) while each still covers a layer as little served as the neediest window's weakest. On
    an empty swarm, one per piece of a tiling of the model; where one window lacks most, it alone."""
    n = max(1, min(n, len(planned)))
    view = list(planned)
    first = _neediest_starts(planned, n)[0]
    floor = min(planned[first:first + n])
    fills: list[tuple[int, int]] = []
    while len(fills) < len(planned):
        s = _neediest_starts(view, n)[0]
        if fills and min(view[s:s + n]) > floor:
            break
        fills.append(_window(s, n))
        _add(view, s, s + n, tput)
    return fills


def spread_window(planned: list[float], n: int, peer: str, *, tput: float = 1.0,
                  keep: tuple[int, int] | None = None) -> tuple[int, int]:
    """The window a joining peer takes, given the swarm as it sees it (``planned``): of the
    windows as needy as the neediest (``window_fills``), ``keep`` (the span it chose before
    looking again) if among them, else the one a hash of its peer ID names: the same each time
    one peer looks at the same swarm, different from peer to peer, so that peers that see the
    same swarm (joining at the same moment) spread over those windows instead of all taking one."""
    fills = window_fills(planned, n, tput=tput)
    return keep if keep in fills else fills[peer_rank(peer) % len(fills)]


def peer_rank(peer: str) -> int:
    """A number drawn from the peer ID (SHA-256): the same in every process, uniform across peers."""
    return int.from_bytes(hashlib.sha256(peer.encode()).digest()[:8], "big")


def _window(start: int, n: int) -> tuple[int, int]:
    return start, start + n


@dataclass(frozen=True)
class Move:
    start: int
    end: int
    bottleneck_now: float
    bottleneck_after: float


def plan_move(claims: Iterable[Claim], me: Claim, num_layers: int, *, margin: float = 0.2,
              rng: random.Random | None = None) -> Move | None:
    """Where ``me`` should move, or None. ``claims`` are the live claims (``me`` may be among them)."""
    others = [c for c in claims if c.peer != me.peer]
    staying = staying_throughput(others, num_layers)
    if any(staying[layer] <= 0 for layer in range(me.start, me.end)):
        # we are the only server of a layer that will stay: others may be loading it (not
        # serving yet) or serving it while they load another span (leaving it soon)
        return None
    planned = planned_throughput(others, num_layers)
    start, end, tput = me.start, me.end, max(me.tput, 0.0)
    now = min(_with(planned, start, end, tput))
    new_start, new_end = best_window(planned, end - start, rng=rng)
    if (new_start, new_end) == (start, end):
        return None
    moved = _with(planned, new_start, new_end, tput)
    after = min(moved)
    if after > now * (1 + margin) or (now <= 0 < after):
        return Move(new_start, new_end, now, after)
    if now <= 0 and _unserved(moved) < _unserved(_with(planned, start, end, tput)):
        # More layers are unserved than one peer can fill: no single move lifts the bottleneck
        # off zero, yet each that fills some of them brings the swarm closer (without this
        # rule, two gaps far apart were never filled; found by bench/swarm_sim).
        return Move(new_start, new_end, now, after)
    return None


def _unserved(served: list[float]) -> int:
    return sum(1 for x in served if x <= 0)


def _with(served: list[float], start: int, end: int, tput: float) -> list[float]:
    return [x + tput if start <= layer < end else x for layer, x in enumerate(served)]


def upkeep_step(interval: float, *, gap: bool, settling: bool) -> float:
    """Seconds until a serving peer looks at the swarm again: soon (``FAST_INTERVAL``) while a
    layer it could fill is unserved or it only just chose its span, else ``interval``. The peer
    sleeps it times a factor drawn from ``UPKEEP_JITTER``, so that peers fall out of step and do
    not all move at once."""
    return min(interval, FAST_INTERVAL) if gap or settling else interval


UPKEEP_JITTER = (0.75, 1.25)
#: seconds (drawn) a peer waits after the connection to a claimed peer closed before it looks
#: at the swarm: the other departures of a burst (a rack, a region) come in meanwhile
DEPARTURE_DELAY = (1.0, 3.0)


def fillable_gap(claims: Iterable[Claim], start: int, end: int, num_layers: int) -> bool:
    """Whether a layer nobody serves or loads could be filled by the peer serving ``start:end``
    (``claims``: the others'): some layer outside its span is left to nobody, and every layer
    of its span is served by another that stays."""
    claims = list(claims)
    planned = planned_throughput(claims, num_layers)
    staying = staying_throughput(claims, num_layers)
    return (any(x <= 0 for layer, x in enumerate(planned) if not start <= layer < end)
            and all(staying[layer] > 0 for layer in range(start, end)))


def move_turn_delay(rank: int, step: float, rng: random.Random) -> float:
    """Before moving, a peer waits its turn among the peers on the same span (``rank`` by peer
    ID), each looking again after the ones before it had a round to act."""
    return rank * step * 1.5 + rng.uniform(0, min(1.0, step / 4))


def coverage(claims: Iterable[Claim], num_layers: int) -> list[dict]:
    """Per layer: the peers serving it and their summed throughput (for status displays)."""
    rows = [{"layer": i, "peers": [], "tput": 0.0} for i in range(num_layers)]
    for c in claims:
        if not c.serving:
            continue
        for layer in range(max(c.start, 0), min(c.end, num_layers)):
            rows[layer]["peers"].append(c.peer)
            rows[layer]["tput"] += max(c.tput, 0.0)
    return rows
