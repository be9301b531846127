"""A compute peer's side of the activation protocol: serving its block to sessions.

Per session a block server: checks the model ID, layer range and KV budget; opens the next hop
(or the return stream to the client, if it is last); answers ``ready`` upstream; then for each
``step`` runs its layers (in a worker thread, in the forward pass the block's one scheduler,
``scheduler.py``, puts it in, maybe with other sessions' steps) and passes the output on. Errors
go back upstream as ``error`` messages, relayed hop by hop to the client; a failing session never
affects the others. The router (``inference/router.py``) hands it the
streams that start with ``open``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import trio
from prometheus_client import Histogram

from shardnet.errors import InferenceError, ShardnetError
from shardnet.inference.latency_buckets import STEP_BUCKETS
from shardnet.inference.model import wire
from shardnet.inference.model.block import Block, Head, dtype_name
from shardnet.inference.receipt_service import ReceiptService, StageRecorder
from shardnet.inference.router import ActivationRouter
from shardnet.inference.server.prefix_store import PAGE, PrefixStore, PrefixTracker, row_digests, session_seed
from shardnet.inference.server.scheduler import DEFAULT_MAX_TOKENS, BlockScheduler
from shardnet.protocols import activation as ap
from shardnet.protocols.activation import ErrorCode
from shardnet.protocols.activation_io import (
    FOREVER,
    OPEN_TIMEOUT,
    MessageStream,
    open_hop,
    reply_error,
    send_reply,
)
from shardnet.protocols.activation_session import (
    BlockSession,
    Compute,
    Failure,
    ForwardClose,
    Relay,
    ReplyError,
    Skip,
    answer_to_open,
)
from shardnet.transport import allocator
from shardnet.transport.limits import PeerCounts, Refusals, TokenBuckets
from shardnet.transport.node import Node

log = logging.getLogger(__name__)

#: after a step of this many positions or more, the heap's freed memory goes back to the system at
#: once (the node keeps buffers below 64 MiB in the heap: transport/allocator.py)
TRIM_AFTER_TOKENS = 256


@dataclass
class KvBudget:
    """Bytes of KV cache this block may hold: the open sessions' caches (each reserved whole at
    open), and in what they leave free, prefix pages (prefix_store.py), evicted least recently
    used first when a session or a newer page needs the room."""

    limit: int
    used: int = 0
    sessions: dict[bytes, int] = field(default_factory=dict)
    prefixes: PrefixStore = field(default_factory=PrefixStore)

    @property
    def held(self) -> int:
        """Bytes held now: sessions' caches and prefix pages."""
        return self.used + self.prefixes.nbytes

    def room(self, nbytes: int) -> bool:
        """Make room for a prefix page of ``nbytes`` (evicting older pages); False if it cannot fit."""
        if self.used + nbytes > self.limit:
            return False
        if self.held + nbytes > self.limit:
            self.prefixes.evict(self.held + nbytes - self.limit)
        return True

    def reserve(self, session: bytes, nbytes: int) -> None:
        if self.held + nbytes > self.limit and self.used + nbytes <= self.limit:
            self.prefixes.evict(self.held + nbytes - self.limit)
        if self.used + nbytes > self.limit:
            raise InferenceError(ErrorCode.KV_BUDGET, f"session needs {nbytes} bytes of KV cache; "
                                 f"{self.limit - self.used} of {self.limit} are free",
                                 need_bytes=nbytes, limit_bytes=self.limit)
        self.sessions[session] = nbytes
        self.used += nbytes

    def release(self, session: bytes) -> None:
        self.used -= self.sessions.pop(session, 0)


class BlockActivity:
    """What the served block did, for monitors: steps, tokens and bytes through it, and how long a
    step took from its arrival to its result leaving (this hop's share of a chain step's time)."""

    def __init__(self) -> None:
        self.sessions_total = 0
        self.steps_total = 0
        self.tokens_total = 0
        self.bytes_in_total = 0
        self.bytes_out_total = 0
        # not registered anywhere: the node's metrics collector reports it (prometheus_client
        # keeps the buckets, so what is scraped is exactly what it would have made)
        self.step_seconds = Histogram("shardnet_block_step_seconds", "a step's time at this hop: arrival to "
                                      "result sent on (compute, batching wait, the send)", registry=None,
                                      buckets=STEP_BUCKETS)

    def step(self, tokens: int, bytes_in: int, bytes_out: int, seconds: float) -> None:
        self.steps_total += 1
        self.tokens_total += tokens
        self.bytes_in_total += bytes_in
        self.bytes_out_total += bytes_out
        self.step_seconds.observe(seconds)


@dataclass
class ServedBlock:
    block: Block
    model_id: str
    kv: KvBudget
    head: Head | None = None  # present when this peer may apply norm + LM head (last block)
    idle_timeout: float = 300.0
    sessions_served: int = 0
    #: the token budget of a forward pass over several sessions' steps (0: one step per pass)
    batch_tokens: int = DEFAULT_MAX_TOKENS
    #: where the operator says this peer is (`join --region`), stated in its stage receipts
    region: str | None = None
    #: what every forward pass of the block holds, for every session's steps
    scheduler: BlockScheduler = field(init=False)

    def __post_init__(self) -> None:
        self.scheduler = BlockScheduler(self.block, max_tokens=self.batch_tokens)


class BlockEndpoint:
    """Serves this node's block to sessions the activation router hands over (``open``); its
    ``ComputePeer`` owns it (one per node: it takes the router's ``on_open``)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.limits = node.config.limits
        self.served: ServedBlock | None = None
        #: sessions open per upstream peer, and the rate each may open new ones at
        self.sessions_by_peer = PeerCounts()
        self._session_rate = TokenBuckets(self.limits.session_rate_per_peer, self.limits.session_burst_per_peer)
        self.refusals = Refusals()
        #: what this peer's block did, for monitors
        self.activity = BlockActivity()
        ActivationRouter.of(node).on_open = self._serve_session

    def serve(self, served: ServedBlock) -> None:
        self.served = served
        ReceiptService.of(self.node)  # sessions end in signed receipts, served on request

    # -- server side ---------------------------------------------------------------------------
    async def _serve_session(self, up: MessageStream, op: ap.Open) -> None:
        s = op.session
        sb = self.served
        try:
            if sb is None:
                raise InferenceError(ErrorCode.NO_BLOCK, "this peer serves no block")
            if op.model != sb.model_id:
                raise InferenceError(ErrorCode.WRONG_MODEL, f"this peer serves model {sb.model_id[:16]}…, "
                                     f"not {op.model[:16]}…")
            start, end = op.layers
            if not sb.block.start <= start < end <= sb.block.end:
                raise InferenceError(ErrorCode.LAYERS, f"layers {start}:{end} requested; this peer serves "
                                     f"{sb.block.start}:{sb.block.end} of {sb.block.ckpt.num_layers} "
                                     f"(any range within it)")
            if op.logits and not op.chain and (sb.head is None or end != sb.block.ckpt.num_layers):
                raise InferenceError(ErrorCode.NO_HEAD, "this peer does not hold the LM head" if sb.head is None
                                     else f"the LM head follows layer {sb.block.ckpt.num_layers - 1}; "
                                          f"this session's layers end at {end}")
            self._admit_session(up.remote_peer)
            sb.kv.reserve(s, op.max_len * sb.block.kv_bytes_per_token(_sub_span(sb, op)))
        except InferenceError as e:
            await reply_error(up, s, e.code, e.message, **e.figures)
            return
        self.sessions_by_peer[up.remote_peer] += 1
        try:
            session = BlockSession(op, sb.block.config.hidden_size)
            rec = StageRecorder(sb.model_id, s, (start, end), str(self.node.peer_id),
                                str(sb.block.device), dtype=dtype_name(sb.block.dtype),
                                quant=sb.block.quantize or "none", batching=sb.scheduler.batching,
                                region=sb.region)
            rec.received.add(op.raw)
            up.received_hash = rec.received
            rec.observed["upstream"] = up.observed()
        except BaseException:  # (the session never started: what it was granted goes back)
            sb.kv.release(s)
            self.sessions_by_peer.release(up.remote_peer)
            raise
        sb.sessions_served += 1
        self.activity.sessions_total += 1
        if session.returns_logits:
            rec.tokens = []
        down: MessageStream | None = None
        try:
            try:
                down, rest_takes_trees = await self._open_next(session, rec)
                rec.observed["downstream"] = down.observed()
            except InferenceError as e:
                await reply_error(up, s, e.code, e.message, peer=e.peer, **e.figures)
                return
            await up.send(session.ready(tree=sb.block.takes_trees and rest_takes_trees))
            async with trio.open_nursery() as nursery:
                if not session.last:
                    nursery.start_soon(_relay_errors, session, down, up, nursery.cancel_scope)
                await self._step_loop(sb, session, up, down, rec)
                nursery.cancel_scope.cancel()
        except (ShardnetError, trio.TooSlowError) as e:
            log.info("session %s ended: %s", s.hex()[:8], e)
        finally:
            sb.kv.release(s)
            self.sessions_by_peer.release(up.remote_peer)
            if down is not None:
                with trio.move_on_after(5):
                    await down.close()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                try:
                    await ReceiptService.of(self.node).sign_and_keep(rec.receipt())
                except Exception as e:  # a receipt must never take the server down
                    log.warning("session %s: no receipt: %s", s.hex()[:8], e)

    def _admit_session(self, peer: str) -> None:
        """Raise InferenceError when ``peer`` may not open another session now."""
        limits = self.limits
        held = self.sessions_by_peer[peer]
        if held >= limits.sessions_per_peer:
            self.refusals.note("sessions_per_peer", peer,
                               f"limit sessions_per_peer: {peer[:16]} holds {held} sessions; refusing another")
            raise InferenceError(ErrorCode.TOO_MANY_SESSIONS, f"you hold {held} sessions here, "
                                 f"the most this peer allows one peer (sessions_per_peer)")
        if not self._session_rate.take(peer):
            self.refusals.note("session_rate_per_peer", peer, f"limit session_rate_per_peer: {peer[:16]} opens "
                                                              f"sessions faster than {limits.session_rate_per_peer:g}/s")
            raise InferenceError(ErrorCode.RATE_LIMITED, f"more than {limits.session_rate_per_peer:g} new sessions "
                                 f"per second (session_rate_per_peer); try again shortly",
                                 retry_after_s=self._session_rate.retry_after(peer))

    async def _open_next(self, session: BlockSession,
                         rec: StageRecorder | None = None) -> tuple[MessageStream, bool]:
        """Open the next hop with the rest of the chain, or the return stream to the client; and
        whether the rest of the chain takes tree steps (its ready says so; true past the last hop)."""
        target, first = session.downstream()
        ms, reply = await open_hop(self.node, target.peer, target.addrs, first,
                                   reply_timeout=None if session.last else OPEN_TIMEOUT,
                                   sent_hash=rec.sent if rec is not None else None)
        if not session.last:
            failure = answer_to_open(reply, who="next hop",
                                     closed=Failure(ErrorCode.NEXT_HOP, "next hop closed the stream", target.peer))
            if failure is not None:
                if reply is None or isinstance(reply, ap.Error):
                    await ms.close()
                raise InferenceError(failure.code, failure.message, failure.peer, need_bytes=failure.need_bytes,
                                     limit_bytes=failure.limit_bytes, retry_after_s=failure.retry_after_s)
            return ms, reply.tree
        return ms, True

    async def _step_loop(self, sb: ServedBlock, session: BlockSession, up: MessageStream, down: MessageStream,
                         rec: StageRecorder | None = None) -> None:
        # allocated now at the session's length, exactly what sb.kv reserved for it; freed when the
        # session ends (the last reference goes: a pass still running its step holds one until done)
        op = session.open
        layers = _sub_span(sb, op)
        cache = sb.block.new_cache(op.max_len, layers)
        # (prefix pages are kept per layer range: a sub-span session's hold only its layers)
        tracker = None if op.prefix is None else PrefixTracker(
            session_seed(sb.model_id, tuple(op.layers), dtype_name(sb.block.dtype), op.prefix, op.ret.peer))
        # other peers compute this session's steps too (scheduler: the halves of such sessions alternate)
        pipelined = not session.last or str(up.remote_peer) != op.ret.peer
        while True:
            # the last step's buffers (frame, payload, tensors: megabytes for a prompt) go before the wait
            msg = action = step = hidden = out = payload = digests = reused = None
            try:
                msg = await up.recv(sb.idle_timeout)
            except trio.TooSlowError:
                action = session.idle(sb.idle_timeout)
            except ap.ActivationProtocolError as e:
                action = session.bad_frame(e)
            else:
                action = session.end_of_input() if msg is None else session.receive(msg, up.pending)
            if isinstance(action, Skip):
                continue
            if isinstance(action, ReplyError):
                await send_reply(up, action)
                return
            if isinstance(action, ForwardClose):
                await down.send(action.message)
                return
            if not isinstance(action, Compute):
                return
            step = action.step
            t_step = time.perf_counter()
            if step.tree is not None and not sb.block.takes_trees:
                await send_reply(up, session.refuse(step, "this block does not take tree steps"))
                return
            if step.keep is not None:  # a tree step's accepted path, kept in place of the tree
                cache.keep(step.keep[0], [k - step.keep[0] for k in step.keep])
            if tracker is not None and (step.tree is not None or step.keep is not None):
                tracker.rollback(step.keep[0] if step.keep else step.pos, sb.kv.prefixes)
                tracker = None  # stored prefixes are sequences: none past a tree
            if action.drop > 0:
                # Rollback: the client rejected speculated tokens; forget everything from pos on.
                cache.crop(-action.drop)
            hidden = wire.from_message(step)
            reused: list = []
            if tracker is not None:
                digests, reused = await trio.to_thread.run_sync(_reuse_prefix, sb, tracker, cache, step.pos, hidden)
                sb.kv.prefixes.stats.hit_pages += len(reused)
            done = len(reused) * PAGE
            out = await sb.scheduler.forward(up.remote_peer, hidden[:, done:], cache, step.pos + done,
                                             on_shared=rec.step_was_batched if rec is not None else None,
                                             pipelined=pipelined, tree=step.tree, layers=layers)
            if reused:
                out = torch.cat([torch.cat([p.outputs for p in reused])[None].to(out.dtype), out], dim=1)
            if tracker is not None:
                await trio.to_thread.run_sync(tracker.record, digests, out, cache, sb.kv.prefixes, sb.kv.room)
            out, kind = await _head(sb, session, step, rec, out)
            # hidden states go on in the session's wire dtype (default: as they came); logits in float32
            dtype, shape, payload = wire.to_payload(out, None if kind == "logits" else session.open.wire or step.dtype)
            try:
                await down.send(session.output(step, dtype=dtype, shape=shape, payload=payload, kind=kind))
            except ShardnetError as e:
                await send_reply(up, session.send_failed(step, str(e), down.remote_peer))
                return
            self.activity.step(hidden.shape[1], len(step.payload), len(payload), time.perf_counter() - t_step)
            if hidden.shape[1] >= TRIM_AFTER_TOKENS:  # a prompt's transient buffers, freed: give them back
                await trio.to_thread.run_sync(allocator.trim)


def _sub_span(sb: ServedBlock, op: ap.Open) -> tuple[int, int] | None:
    """The layers a session runs when they are not the whole block (a sub-span session), else None."""
    layers = tuple(op.layers)
    return None if layers == (sb.block.start, sb.block.end) else layers


def _reuse_prefix(sb: ServedBlock, tracker: PrefixTracker, cache, pos: int, hidden):
    """The step's input rows' digests, and the stored prefix pages that continue the session at
    ``pos``, already copied into its cache (prefix_store.py)."""
    tracker.rollback(pos, sb.kv.prefixes)
    digests = row_digests(hidden)
    reused = tracker.lookup(sb.kv.prefixes, pos, digests)
    for page in reused:
        cache.append(page.kv)
    return digests, reused


async def _head(sb: ServedBlock, session: BlockSession, step, rec: StageRecorder | None, out):
    """The block's output as the session wants it: hidden states, or (last block with the head)
    the logits of the positions asked for."""
    if not session.returns_logits:
        return out, "hidden"
    n_logits = min(step.logits_for, out.shape[1])
    out = await trio.to_thread.run_sync(sb.head.logits, out[:, -n_logits:, :])
    if rec is not None and rec.tokens is not None:
        rec.tokens.extend(out[0].argmax(-1).tolist())
    return out, "logits"


async def _relay_errors(session: BlockSession, down: MessageStream, up: MessageStream,
                        scope: trio.CancelScope) -> None:
    """Errors from further down the chain travel back up, hop by hop (any other message ends the
    session: frames only flow one way on each stream). Runs for the session's
    life (the step loop's idle timeout bounds that), so it waits without a deadline of its own."""
    try:
        action = session.from_downstream(await down.recv(FOREVER), down.remote_peer)
        if isinstance(action, Relay):
            await up.send(action.message)
        else:
            await send_reply(up, action)
    except ShardnetError as e:
        await send_reply(up, session.downstream_broken(str(e), down.remote_peer))
    scope.cancel()
