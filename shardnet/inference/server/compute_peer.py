"""A compute peer: load a block, serve it on the activation protocol, keep its claim published;
pick the block itself when not told, and move when the swarm needs it elsewhere.

``serve_block`` serves a fixed span (tests, benchmarks, ``join --layers``). ``join_swarm`` is
what ``shardnet join`` runs: with no span given it sizes one from free memory, takes the window
of layers the swarm needs most (``placement``), and every ``rebalance_interval`` seconds looks
at the live claims again: it measures round trips to the peers serving the layers after its
own (published in its claim, for clients' routing) and moves when that raises the swarm's
bottleneck throughput by a margin without leaving any layer unserved. A move loads the new
block first; sessions already open finish on the old one.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import trio

from shardnet.inference.claims import CLAIM_TTL, RTT_SAMPLES, find_claims, live_claims
from shardnet.inference.claims_view import ClaimsView
from shardnet.inference.model.block import (
    Block,
    Head,
    dtype_name,
    pick_device,
    resolve_dtype,
)
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.family_check import ensure_family_matches
from shardnet.inference.server.block_endpoint import (
    BlockEndpoint,
    KvBudget,
    ServedBlock,
)
from shardnet.inference.server.claim_publisher import ClaimPublisher
from shardnet.inference.server.placement import (
    DEFAULT_REBALANCE_INTERVAL,
    DEPARTURE_DELAY,
    REBALANCE_MARGIN,
    SETTLE_S,
    UPKEEP_JITTER,
    Move,
    affordable_layers,
    fillable_gap,
    move_turn_delay,
    plan_move,
    planned_throughput,
    spread_window,
    unmeasured_tput,
    upkeep_step,
)
from shardnet.inference.server.scheduler import DEFAULT_MAX_TOKENS
from shardnet.inference.services import inference_services
from shardnet.inference.weights.fetcher import ProgressFn
from shardnet.inference.weights.server import WeightServer
from shardnet.inference.weights.swarm_model import fetch_tensors, span_tensor_names
from shardnet.protocols import block_claim as bc
from shardnet.protocols.block_claim import Claim
from shardnet.protocols.receipts import region_problem
from shardnet.transport import allocator
from shardnet.transport.errors import ShardnetError
from shardnet.transport.node import Node

log = logging.getLogger(__name__)

DEFAULT_KV_BUDGET = 512 << 20
#: A joining peer waits this long (uniformly at random) after choosing, then looks again before
#: it loads: a peer that joined just before it has published its claim by then.
RECHECK_DELAY = (0.5, 2.5)


#: after this many seconds the throughput measurement takes the rounds it has
MEASURE_S = 3.0
#: seconds between a compute peer's lookups of the claims (gossip brings news in between; a
#: lookup brings refreshed claims, which are not gossiped): half the claims' TTL. A claim is
#: rebuilt at least every third of the TTL, so one a lookup brings lives at least two thirds of
#: the TTL more, past the next lookup
UPKEEP_LOOKUP_S = CLAIM_TTL / 2
#: the most claims of peers we are not connected to that one upkeep round pings
UPKEEP_PINGS = 16
#: a successor's round trip is measured again once it is this old (seconds; the next upkeep after):
#: round trips change slowly, and pinging each successor every minute grew with the swarm
SUCCESSOR_RTT_MAX_AGE_S = 600.0
#: the most seconds the lookup before a planned move takes (then the view as it is decides)
MOVE_LOOKUP_TIMEOUT = 10.0


def measure_throughput(block: Block, tokens: int = 8, rounds: int = 3) -> float:
    """Tokens per second of decode-like forwards, the best of a few rounds: what the hardware
    does when nothing else competes (a peer loading next door must not make us look slow)."""
    hidden = torch.zeros(1, 1, block.config.hidden_size, dtype=block.dtype, device=block.device)
    cache = block.new_cache()
    block.forward(hidden, cache, 0)  # warm-up
    best = float("inf")
    began = time.perf_counter()
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(tokens):
            block.forward(hidden, cache, 1 + r * tokens + i)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - began > MEASURE_S:  # a slow block (weights dequantized per call) starts sooner
            break
    return tokens / max(best, 1e-9)


def free_memory_bytes(device: str) -> int:
    """Memory a new block could use: free GPU memory, or the RAM the kernel calls available."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Upkeep:
    """What a serving peer's upkeep carries from one round to the next."""

    publisher: ClaimPublisher
    rebalance: bool  # whether it may move (a span it chose itself)
    on_move: Callable[[Move, tuple[int, int]], None] | None
    rng: random.Random
    settle_until: float = 0.0  # trio time: look again soon until then (the span is new)
    gap: bool = False  # a layer nobody serves that we could fill was seen last round
    step: float = 0.0  # this round's interval


class ComputePeer:
    """One peer's block (replaceable), its claim, and the upkeep that keeps both right."""

    def __init__(self, node: Node, model_path: str | Path, *, dtype: str = "auto", device: str | None = None,
                 kv_budget_bytes: int = DEFAULT_KV_BUDGET, idle_timeout: float | None = None,
                 hold_head: bool = False, throughput: float | None = None, quantize: str | None = None,
                 fetch_progress: ProgressFn | None = None, names: list[str] = (),
                 batch_tokens: int | None = DEFAULT_MAX_TOKENS, region: str | None = None) -> None:
        self.node = node
        #: where the operator says this peer is (stated in its stage receipts; not proven)
        if region is not None and (problem := region_problem(region)):
            raise ShardnetError(f"--region {region!r}: {problem}")
        self.region = region
        #: continuous batching: the most tokens of concurrent sessions' steps one forward pass
        #: takes (0 or None: one session's step per pass, in fair turns between upstream peers)
        self.batch_tokens = batch_tokens
        #: called as the tensors of a span are fetched (a checkpoint the swarm fills)
        self.fetch_progress = fetch_progress
        #: names the model is published by besides the checkpoint's own (e.g. a hub repo)
        self.names = list(names)
        #: how the block's weights are quantized at load (None: as the checkpoint computes)
        self.quantize = quantize
        #: tokens/s to advertise instead of a measurement (None: measure each block loaded)
        self.fixed_throughput = throughput
        self.ckpt = Checkpoint(model_path)
        self.model_id = self.ckpt.model_id
        self.device = pick_device(device)
        self.dtype = resolve_dtype(dtype, self.ckpt, self.device)
        ensure_family_matches(self.ckpt, dtype=self.dtype)  # the head, where it is stored here
        self.dtype_name = dtype_name(self.dtype)
        self.kv_budget_bytes = kv_budget_bytes
        #: seconds a session may idle (default: the node's session_idle_s limit)
        self.idle_timeout = node.config.limits.session_idle_s if idle_timeout is None else idle_timeout
        self.hold_head = hold_head
        self.served: ServedBlock | None = None
        #: when this peer began serving (Unix time; claims carry it, for uptime displays)
        self.since = time.time()
        self.tput = 0.0
        self.successor_rtts: dict[str, float] = {}
        self._rtt_measured: dict[str, float] = {}  # when each successor's round trip was measured (trio time)
        self.moves: list[Move] = []
        #: the span being loaded (claimed as such, so that other peers choose around it)
        self.loading: tuple[int, int] | None = None
        #: set when the connection to a peer we hold a claim of closes: upkeep looks again soon
        self._departed = trio.Event()
        #: what this node's parts share (its clients too, if it runs any): the metrics report our block
        self.services = inference_services(node)
        #: the claims for our model as this node knows them (news gossiped on our span's
        #: neighbourhood of layer ranges; every range looked up rarely): what upkeep and placement
        #: decide on
        self.view = ClaimsView.of(node, self.model_id, self.services.probes, num_layers=self.ckpt.num_layers,
                                  refresh_s=UPKEEP_LOOKUP_S)
        #: serves the loaded block to the sessions the node's activation router hands over (until
        #: the first load it answers that this peer serves no block)
        self.endpoint = BlockEndpoint(node)
        self.services.metrics.watch_block(self.endpoint)

    @property
    def span(self) -> tuple[int, int]:
        b = self.served.block
        return b.start, b.end

    def follow_neighbourhood(self, *spans: tuple[int, int]) -> None:
        """Have the claims view follow the gossip of the layer ranges of the span we serve, the
        one we are loading and ``spans``, and of the layer after each (``block_claim.neighbourhood``):
        the news of the peers whose spans start inside ours or at its end (span-mates,
        successors) arrives as it happens, the rest of the swarm's with the lookups."""
        spans += tuple(s for s in (self.span if self.served is not None else None, self.loading) if s)
        self.view.follow({i for a, b in spans for i in bc.neighbourhood(a, b, self.ckpt.num_layers)})

    async def load(self, start: int, end: int) -> ServedBlock:
        """Load layers start..end and serve them to new sessions (open ones keep their block)."""
        ckpt = self.ckpt
        self.follow_neighbourhood((start, end))  # both spans' neighbours while loading
        if ckpt.fetched:
            await fetch_tensors(self.node, ckpt, span_tensor_names(ckpt, start, end),
                                progress=self.fetch_progress)
        with allocator.loading():  # (its transient buffers go back to the system as they are freed)
            # every distinct layer configuration of the span against transformers (kept: once each)
            await trio.to_thread.run_sync(partial(ensure_family_matches, ckpt, (start, end), dtype=self.dtype))
            log.info("loading layers %d:%d of %s (%s%s, %s)", start, end, ckpt.path.name, self.dtype_name,
                     f", weights {self.quantize}" if self.quantize else "", self.device)
            block = await trio.to_thread.run_sync(
                lambda: Block(ckpt, start, end, dtype=self.dtype, device=self.device, quantize=self.quantize))
            # measured by a forward on one token: here, not on the event loop at the first claim
            await trio.to_thread.run_sync(block.kv_bytes_per_token)
        r = block.load_report
        log.info("loaded %d tensors (%.1f MB) in %.2f s", r.tensors, r.bytes / 1e6, r.seconds)
        head = None
        if self.hold_head and end == ckpt.num_layers:
            head = Head(ckpt, dtype=self.dtype, device=self.device, embed=False, lm_head=True)
        if self.fixed_throughput is not None:
            self.tput = self.fixed_throughput
        else:
            self.tput = await trio.to_thread.run_sync(measure_throughput, block)
        # (the measurement runs as serving will, outside ``loading``: what it freed goes back too)
        allocator.trim()
        served = ServedBlock(block, self.model_id, KvBudget(self.kv_budget_bytes), head=head,
                             idle_timeout=self.idle_timeout,
                             batch_tokens=self.batch_tokens or 0,
                             region=self.region)
        self.endpoint.serve(served)
        self.served = served
        self.follow_neighbourhood()  # (the span we serve now, and any still loading)
        for peer in self.successor_rtts:  # (the next upkeep measures the new span's successors)
            self.node.connection_manager.unprotect(peer, "successor")
        self.successor_rtts = {}
        return served

    def claim(self, expires: float) -> Claim:
        """This peer's claim now: the span it serves (and the one it is loading, if any), or,
        before its first block is in, the span it is loading (which clients do not route to)."""
        common = dict(model=self.model_id, addrs=tuple(str(a) for a in self.node.listen_addrs), expires=expires,
                      peer=str(self.node.peer_id), reach=self.node.autonat.status if self.node.autonat else "unknown",
                      dtype=self.dtype_name, quant=self.quantize or "none", since=self.since, loading=self.loading)
        sb = self.served
        if sb is None:
            if self.loading is None:
                raise ShardnetError("no span served or being loaded: nothing to claim")
            return Claim(start=self.loading[0], end=self.loading[1], kv_tokens=0, tput=0.0, **common)
        kv = sb.kv  # (prefix pages give way to sessions: their room counts as free)
        rtts = tuple(sorted(self.successor_rtts.items(), key=lambda kv_: kv_[1]))
        return Claim(start=sb.block.start, end=sb.block.end,
                     kv_tokens=(kv.limit - kv.used) // sb.block.kv_bytes_per_token(), tput=self.tput,
                     load=min(1.0, kv.used / kv.limit) if kv.limit else 0.0, rtts=rtts,
                     sub_spans=True, **common)  # (block_endpoint: any range within the span)

    # -- choosing and revising the span ----------------------------------------------------------
    async def choose_span(self, *, max_layers: int | None = None, wait: float = 5.0) -> tuple[int, int]:
        """How many layers fit here, and the window of that size the swarm needs most (among
        equally needy ones, the one this peer's ID names: placement.spread_window)."""
        n = affordable_layers(self.ckpt, self.dtype_name, free_memory_bytes(self.device), quantize=self.quantize,
                              reserve_bytes=self.kv_budget_bytes, max_layers=max_layers)
        claims = await self.live_claims(wait)
        served = planned_throughput(claims, self.ckpt.num_layers)
        start, end = spread_window(served, n, str(self.node.peer_id), tput=unmeasured_tput(claims))
        log.info("room for %d of %d layers; the swarm serves %s tok/s per layer: taking %d:%d",
                 n, self.ckpt.num_layers, [round(x, 1) for x in served], start, end)
        return start, end

    async def recheck_span(self, span: tuple[int, int], *, wait: float = 5.0) -> tuple[int, int]:
        """``span`` if it is still among the windows to take, given the claims now; else the one
        of them this peer's ID names."""
        start, end = span
        claims = await self.live_claims(wait)
        served = planned_throughput(claims, self.ckpt.num_layers)
        best = spread_window(served, end - start, str(self.node.peer_id), tput=unmeasured_tput(claims), keep=span)
        if best != span:
            log.info("the swarm changed while choosing (%d live claims): taking %d:%d instead of %d:%d",
                     len(claims), *best, start, end)
        return best

    async def live_claims(self, wait: float = 5.0, *, look_up: bool = True) -> list[Claim]:
        """Other peers' claims for this model whose peers are live: connected to us, or answering a
        ping. ``look_up``: look the claims up now (DHT providers, then each peer); otherwise the
        claims view's (gossiped news, looked up every ``UPKEEP_LOOKUP_S``)."""
        me = str(self.node.peer_id)
        if look_up:
            claims = await find_claims(self.node, self.model_id, num_layers=self.ckpt.num_layers, timeout=wait)
            for c in claims:
                self.view.note(c)
        else:
            self.view.start()
            if not self.view.lookups:
                with trio.move_on_after(wait):
                    await self.view.first_lookup.wait()
            claims = self.view.current()
        claims = [c for c in claims if c.peer != me]
        if not look_up:
            # upkeep: peers we are connected to are live (keepalive closes dead connections, and
            # a closed one wakes upkeep); of the others, ping at most UPKEEP_PINGS, our chain
            # neighbours and span-mates first, and trust the rest until their claims expire:
            # pinging every claim each round grew with the swarm (docs/scale.md)
            start, end = self.span if self.served is not None else (-1, -1)
            random.shuffle(claims)
            claims.sort(key=lambda c: not (c.start == end or c.end == start or (c.start, c.end) == (start, end)))
        return await live_claims(self.node, claims, connected_are_live=True,
                                 ping_most=None if look_up else UPKEEP_PINGS)

    async def measure_successors(self, claims: list[Claim]) -> None:
        """Round trips to the peers serving the layers right after ours (for clients' routing):
        a successor new to us is pinged at once, a known one again once its round trip is
        ``SUCCESSOR_RTT_MAX_AGE_S`` old (upkeep runs every 2 s while settling; pinging every
        successor each round was most of a settling peer's CPU in a 12-peer swarm)."""
        _, end = self.span
        now = trio.current_time()
        want = [c.peer for c in claims if c.start == end][:32]
        stale = [peer for peer in want if peer not in self.successor_rtts
                 or now - self._rtt_measured.get(peer, -math.inf) >= SUCCESSOR_RTT_MAX_AGE_S]
        pings = await self.node.ping_many(stale, timeout=3.0, samples=RTT_SAMPLES) if stale else {}
        successors = {}
        for peer in want:
            if peer in pings:
                if pings[peer].rtt is not None:
                    successors[peer] = pings[peer].rtt
                    self._rtt_measured[peer] = now
            elif peer in self.successor_rtts:
                successors[peer] = self.successor_rtts[peer]
        self._rtt_measured = {peer: t for peer, t in self._rtt_measured.items() if peer in successors}
        # our chain neighbours keep their connections whatever the connection manager trims
        for peer in self.successor_rtts.keys() - successors.keys():
            self.node.connection_manager.unprotect(peer, "successor")
        for peer in successors:
            self.node.connection_manager.protect(peer, "successor")
        self.successor_rtts = successors

    async def maintain(self, publisher: ClaimPublisher, *, interval: float, rebalance: bool,
                       on_move: Callable[[Move, tuple[int, int]], None] | None = None,
                       rng: random.Random | None = None) -> None:
        """Every ~``interval`` s: refresh successor RTTs and, if allowed, move when it pays."""
        rng = rng or random.Random()
        self._upkeep = _Upkeep(publisher, rebalance, on_move, rng,
                               settle_until=trio.current_time() + SETTLE_S if rebalance else 0.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_departures)
            while True:
                # soon while a layer is unserved or we only just chose our span; else every
                # interval; and soon after a claimed peer's connection closes (it may be gone)
                u = self._upkeep
                u.step = upkeep_step(interval, gap=rebalance and u.gap,
                                     settling=rebalance and trio.current_time() < u.settle_until)
                with trio.move_on_after(u.step * rng.uniform(*UPKEEP_JITTER)):
                    await self._departed.wait()
                    await trio.sleep(rng.uniform(*DEPARTURE_DELAY))  # the rest of a burst comes in
                self._departed = trio.Event()
                try:
                    await self._upkeep_round(u)
                except (ShardnetError, trio.TooSlowError) as e:
                    log.info("swarm upkeep failed this round: %s", e)

    async def _watch_departures(self) -> None:
        """Wake upkeep when the connection to a peer we hold a claim of closes."""
        async with self.node.peer_events() as events:
            async for event in events:
                if event.kind == "disconnected" and self.view.get(str(event.peer_id)) is not None:
                    self._departed.set()

    def _plan(self, claims: list[Claim], rng: random.Random) -> Move | None:
        return plan_move(claims, self.claim(time.time() + 60), self.ckpt.num_layers,
                         margin=REBALANCE_MARGIN, rng=rng)

    async def _upkeep_round(self, u: _Upkeep) -> None:
        """One look at the swarm: successors' round trips, and a move if it pays."""
        claims = await self.live_claims(look_up=False)
        # a gap that we could fill (others serve every layer of ours): look again soon
        u.gap = fillable_gap(claims, *self.span, self.ckpt.num_layers)
        await self.measure_successors(claims)
        log.debug("upkeep: %d live claims; successors' round trips %s", len(claims),
                  {p[:16]: round(t, 4) for p, t in self.successor_rtts.items()})
        if u.rebalance:
            move = self._plan(claims, u.rng)
            if move is not None:
                # Look the claims up first: the view hears news only of its neighbourhood's
                # ranges, so a peer that joined elsewhere since the last lookup is missing from
                # it, and a layer it serves may look unserved (three peers moved where one
                # should have, tests/system/test_placement.py).
                await self.view.lookup(timeout=MOVE_LOOKUP_TIMEOUT)
                # Peers on the same span would all make this move at once: they take turns
                # by peer ID, each looking again after the ones before it had a round to
                # act (a peer that never moves, pinned by --layers, just delays the next).
                same = sorted({c.peer for c in claims if (c.start, c.end) == self.span}
                              | {str(self.node.peer_id)})
                rank = same.index(str(self.node.peer_id))
                await trio.sleep(move_turn_delay(rank, u.step, u.rng))
                move = self._plan(await self.live_claims(look_up=False), u.rng)
            if move is not None:
                old = self.span
                log.warning("moving from layers %d:%d to %d:%d (swarm bottleneck %.1f -> %.1f tok/s)",
                            *old, move.start, move.end, move.bottleneck_now, move.bottleneck_after)
                self.loading = (move.start, move.end)
                u.publisher.refresh()  # others see where we are going while we load
                try:
                    await self.load(move.start, move.end)
                finally:
                    self.loading = None
                weights = self.node.behaviour(WeightServer)
                if weights is not None:
                    weights.add(self.ckpt, self.names)  # it may hold more now
                self.moves.append(move)
                u.settle_until = trio.current_time() + SETTLE_S
                if u.on_move is not None:
                    u.on_move(move, old)
        u.publisher.refresh()


@asynccontextmanager
async def join_swarm(node: Node, model_path: str | Path, *, layers: tuple[int, int] | None = None,
                     max_layers: int | None = None, rebalance_interval: float = DEFAULT_REBALANCE_INTERVAL,
                     claim_ttl: float = CLAIM_TTL, on_move=None, draft_path: str | Path | None = None,
                     **peer_kw) -> AsyncIterator[ComputePeer]:
    """Serve ``layers`` (or a span chosen for the swarm's sake, revised over time) until exit.
    ``draft_path``: a draft model for speculative decoding with this one, served whole beside it
    and named in its model card (clients' ``--speculate auto`` fetch it)."""
    peer = ComputePeer(node, model_path, **peer_kw)
    draft = None if draft_path is None else draft_checkpoint(draft_path, peer.ckpt)  # before loading anything
    chosen = layers is None  # a span we picked we may also leave; one we were given, never
    if layers is None:
        await trio.sleep(random.uniform(0, 1.0))  # peers started together: look one after another
        layers = await peer.choose_span(max_layers=max_layers)
        await trio.sleep(random.uniform(*RECHECK_DELAY))  # and once more before loading
        layers = await peer.recheck_span(layers)
    publisher: ClaimPublisher | None = None
    if chosen:
        # Claim the span while loading it (minutes, when its weights come over a home line):
        # peers joining meanwhile choose around it instead of all taking the same layers.
        peer.loading = layers
        publisher = await node.add_behaviour(ClaimPublisher(node, peer.claim, num_layers=peer.ckpt.num_layers,
                                                            ttl=claim_ttl))
    try:
        await peer.load(*layers)
    except BaseException:
        if publisher is not None:
            node.remove_behaviour(publisher)
        raise
    finally:
        peer.loading = None
    weights = node.behaviour(WeightServer) or await node.add_behaviour(WeightServer(node))
    # (a draft this node serves already, for another model or as a model of its own, stays as it is)
    own_draft = draft is not None and draft.model_id not in weights.models
    if own_draft:
        weights.add(draft, listed=False)
    weights.add(peer.ckpt, peer.names, draft=None if draft is None else draft.model_id)
    if publisher is None:
        publisher = await node.add_behaviour(ClaimPublisher(node, peer.claim, num_layers=peer.ckpt.num_layers,
                                                            ttl=claim_ttl))  # first claim out
    else:
        publisher.refresh()  # serving now
    try:
        async with trio.open_nursery() as nursery:
            if rebalance_interval > 0:
                nursery.start_soon(lambda: peer.maintain(publisher, interval=rebalance_interval,
                                                         rebalance=chosen,
                                                         on_move=on_move))
            try:
                yield peer
            finally:
                nursery.cancel_scope.cancel()
    finally:
        node.remove_behaviour(publisher)  # no more claims once we stop serving
        if own_draft:
            weights.remove(draft.model_id)
        weights.remove(peer.model_id)


@asynccontextmanager
async def serve_block(node: Node, model_path: str, start: int, end: int, *, dtype: str = "auto",
                      device: str | None = None, kv_budget_bytes: int = DEFAULT_KV_BUDGET,
                      idle_timeout: float | None = None, hold_head: bool = False,
                      claim_ttl: float = CLAIM_TTL, quantize: str | None = None,
                      batch_tokens: int | None = DEFAULT_MAX_TOKENS,
                      region: str | None = None) -> AsyncIterator[ServedBlock]:
    """Serve exactly layers start..end (no rebalancing)."""
    async with join_swarm(node, model_path, layers=(start, end), rebalance_interval=0, claim_ttl=claim_ttl,
                          dtype=dtype, device=device, kv_budget_bytes=kv_budget_bytes, idle_timeout=idle_timeout,
                          hold_head=hold_head, quantize=quantize, batch_tokens=batch_tokens, region=region) as peer:
        yield peer.served


def draft_checkpoint(path: str | Path, target: Checkpoint) -> Checkpoint:
    """A draft model's checkpoint for ``target``: whole here (it is served whole: clients run all
    of it), of the target's vocabulary (its tokens are the target's), not the target itself."""
    draft = Checkpoint(Path(path))
    if not draft.holds(list(draft.catalog)):
        raise ShardnetError(f"draft {path}: some of its tensors are not here; a draft is served whole")
    if draft.model_id == target.model_id:
        raise ShardnetError("the draft is the model itself")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ShardnetError(f"draft {draft.path.name}: vocabulary of {draft.config.vocab_size} tokens, the model's "
                            f"is {target.config.vocab_size}: its drafts would be meaningless")
    return draft
