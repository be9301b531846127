"""A compute peer's side of the activation protocol: serving its block to sessions.

Per session a block server: checks the model ID, layer range and KV budget; opens the next hop
(or the return stream to the client, if it is last); answers ``ready`` upstream; then for each
``step`` runs its layers (in a worker thread, one forward at a time per block) and passes the
output on. Errors go back upstream as ``error`` messages, relayed hop by hop to the client; a
failing session never affects the others. The router (``inference/router.py``) hands it the
streams that start with ``open``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from shardnet.errors import InferenceError, ShardnetError
from shardnet.inference.model import wire
from shardnet.inference.model.block import Block, Head
from shardnet.inference.receipt_service import ReceiptService, StageRecorder
from shardnet.inference.router import ActivationRouter
from shardnet.inference.server.turns import FairTurns
from shardnet.protocols import activation as ap
from shardnet.protocols.activation_io import (
    FOREVER,
    OPEN_TIMEOUT,
    MessageStream,
    reply_error,
)
from shardnet.transport.config import peer_info
from shardnet.transport.limits import PeerCounts, Refusals, TokenBuckets
from shardnet.transport.node import Node

log = logging.getLogger(__name__)

@dataclass
class KvBudget:
    """Bytes of KV cache this block may hold across sessions."""

    limit: int
    used: int = 0
    sessions: dict[bytes, int] = field(default_factory=dict)

    def reserve(self, session: bytes, nbytes: int) -> None:
        if self.used + nbytes > self.limit:
            raise InferenceError("kv_budget", f"session needs {nbytes} bytes of KV cache; "
                                 f"{self.limit - self.used} of {self.limit} are free")
        self.sessions[session] = nbytes
        self.used += nbytes

    def release(self, session: bytes) -> None:
        self.used -= self.sessions.pop(session, 0)


@dataclass
class ServedBlock:
    block: Block
    model_id: str
    kv: KvBudget
    head: Head | None = None  # present when this peer may apply norm + LM head (last block)
    idle_timeout: float = 300.0
    compute: FairTurns = field(default_factory=FairTurns)
    sessions_served: int = 0


class BlockEndpoint:
    """Serves this node's block to sessions the activation router hands over (``open``)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.limits = node.config.limits
        self.served: ServedBlock | None = None
        #: sessions open per upstream peer, and the rate each may open new ones at
        self.sessions_by_peer = PeerCounts()
        self._session_rate = TokenBuckets(self.limits.session_rate_per_peer, self.limits.session_burst_per_peer)
        self.refusals = Refusals()
        ActivationRouter.of(node).on_open = self._serve_session

    @classmethod
    def of(cls, node: Node) -> BlockEndpoint:
        ep = getattr(node, "_block_endpoint", None)
        if ep is None:
            ep = node._block_endpoint = cls(node)
        return ep

    def serve(self, served: ServedBlock) -> None:
        self.served = served
        ReceiptService.of(self.node)  # sessions end in signed receipts, served on request

    # -- server side ---------------------------------------------------------------------------
    async def _serve_session(self, up: MessageStream, op: ap.Message) -> None:
        s = op.session
        sb = self.served
        try:
            if sb is None:
                raise InferenceError("no_block", "this peer serves no block")
            if op["model"] != sb.model_id:
                raise InferenceError("wrong_model", f"this peer serves model {sb.model_id[:16]}…, "
                                     f"not {op['model'][:16]}…")
            start, end = op["layers"]
            if (start, end) != (sb.block.start, sb.block.end):
                raise InferenceError("layers", f"layers {start}:{end} requested; this peer serves exactly "
                                     f"{sb.block.start}:{sb.block.end} of {sb.block.ckpt.num_layers}")
            if op.get("logits") and not op["chain"] and sb.head is None:
                raise InferenceError("no_head", "this peer does not hold the LM head")
            self._admit_session(up.remote_peer)
            sb.kv.reserve(s, op["max_len"] * sb.block.kv_bytes_per_token())
        except InferenceError as e:
            await reply_error(up, s, e.code, str(e).split(": ", 1)[1])
            return
        self.sessions_by_peer[up.remote_peer] += 1
        sb.sessions_served += 1
        rec = StageRecorder(sb.model_id, s, (sb.block.start, sb.block.end), str(self.node.peer_id),
                            str(sb.block.device))
        rec.received.add(op.raw)
        up.received_hash = rec.received
        rec.observed["upstream"] = up.observed()
        if op.get("logits") and not op["chain"]:
            rec.tokens = []
        down: MessageStream | None = None
        try:
            try:
                down = await self._open_next(op, rec)
                rec.observed["downstream"] = down.observed()
            except InferenceError as e:
                await reply_error(up, s, e.code, str(e).split(": ", 1)[1], peer=e.peer)
                return
            await up.send(ap.Message("ready", s))
            async with trio.open_nursery() as nursery:
                if op["chain"]:
                    nursery.start_soon(_relay_errors, s, down, up, nursery.cancel_scope)
                await self._step_loop(sb, op, up, down, rec)
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
            raise InferenceError("too_many_sessions", f"you hold {held} sessions here, "
                                 f"the most this peer allows one peer (sessions_per_peer)")
        if not self._session_rate.take(peer):
            self.refusals.note("session_rate_per_peer", peer, f"limit session_rate_per_peer: {peer[:16]} opens "
                                                              f"sessions faster than {limits.session_rate_per_peer:g}/s")
            raise InferenceError("rate_limited", f"more than {limits.session_rate_per_peer:g} new sessions per "
                                 f"second (session_rate_per_peer); try again shortly")

    async def _open_next(self, op: ap.Message, rec: StageRecorder | None = None) -> MessageStream:
        """Open the next hop with the rest of the chain, or the return stream to the client."""
        s, chain = op.session, op["chain"]
        if chain:
            nxt = chain[0]
            target, first = nxt, ap.open_msg(
                s, model=op["model"], layers=tuple(nxt["layers"]), max_len=op["max_len"],
                chain=[ap.Hop(h["peer"], h["addrs"], tuple(h["layers"])) for h in chain[1:]],
                ret=op["ret"], logits=op.get("logits", False), wire=op.get("wire"))
        else:
            target, first = op["ret"], ap.Message("attach", s)
        try:
            await self.node.connect(peer_info(target["peer"], target["addrs"]))
            stream = await self.node.new_stream(target["peer"], ap.PROTOCOL_ID)
        except ShardnetError as e:
            raise InferenceError("next_hop", f"cannot reach {target['peer'][:16]}…: {e}", target["peer"]) from None
        ms = MessageStream(stream)
        if rec is not None:
            ms.sent_hash = rec.sent
        try:
            await ms.send(first)
            reply = await ms.recv(OPEN_TIMEOUT) if chain else None
        except InferenceError:
            raise
        except ShardnetError as e:  # the next hop went away (a reset, its connection lost)
            raise InferenceError("next_hop", f"{target['peer'][:16]}… failed: {e}", target["peer"]) from None
        if chain:
            if reply is None or reply.type == "error":
                await ms.close()
                if reply is None:
                    raise InferenceError("next_hop", "next hop closed the stream", target["peer"])
                raise InferenceError(reply["code"], reply["msg"], reply.get("peer"))
            if reply.type != "ready":
                raise InferenceError("unexpected", f"next hop answered {reply.type}")
        return ms

    async def _step_loop(self, sb: ServedBlock, op: ap.Message, up: MessageStream, down: MessageStream,
                         rec: StageRecorder | None = None) -> None:
        s = op.session
        last = not op["chain"]
        want_logits = last and op.get("logits", False)
        cache = sb.block.new_cache()
        cursor = ap.StepCursor(op["max_len"], sb.block.config.hidden_size)
        while True:
            try:
                msg = await up.recv(sb.idle_timeout)
            except trio.TooSlowError:
                await reply_error(up, s, "idle", f"no step for {sb.idle_timeout:g} s; session expired")
                return
            except ap.ActivationProtocolError as e:
                await reply_error(up, s, e.code, e.message)
                return
            if msg is None:
                return
            if msg.session != s:
                await reply_error(up, msg.session, "unknown_session", "this stream carries another session")
                return
            if msg.type == "close":
                if not last:
                    await down.send(ap.Message("close", s))
                return
            if msg.type != "step":
                await reply_error(up, s, "unexpected", f"expected step or close, got {msg.type}")
                return
            problem = cursor.check(msg)
            if problem:
                await reply_error(up, s, problem[0], problem[1], n=msg["n"])
                return
            epoch = msg.get("e", 0)
            if any(m.type == "step" and m.get("e", 0) > epoch for m in up.pending):
                # Fencing: a newer speculation epoch is already queued behind this chunk, so the
                # client has discarded it. Skip it here and downstream (step numbers may skip).
                cursor.skip(msg)
                continue
            drop = cursor.advance(msg)
            if drop > 0:
                # Rollback: the client rejected speculated tokens; forget everything from pos on.
                cache.crop(-drop)
            hidden = wire.from_message(msg)
            async with sb.compute.turn(up.remote_peer):
                out = await trio.to_thread.run_sync(sb.block.forward, hidden, cache, msg["pos"])
                kind = "hidden"
                if want_logits:
                    n_logits = min(msg.get("logits_for", 1), out.shape[1])
                    out = await trio.to_thread.run_sync(sb.head.logits, out[:, -n_logits:, :])
                    kind = "logits"
                    if rec is not None and rec.tokens is not None:
                        rec.tokens.extend(out[0].argmax(-1).tolist())
            # hidden states go on in the session's wire dtype (default: as they came); logits in float32
            dtype, shape, payload = wire.to_payload(out, None if kind == "logits" else op.get("wire", msg["dtype"]))
            if last:
                out_msg = ap.tensor_msg("result", s, n=msg["n"], pos=msg["pos"], dtype=dtype, shape=shape,
                                        payload=payload, result_kind=kind)
            else:
                out_msg = ap.tensor_msg("step", s, n=msg["n"], pos=msg["pos"], dtype=dtype, shape=shape,
                                        payload=payload, logits_for=msg.get("logits_for"), epoch=msg.get("e"))
            try:
                await down.send(out_msg)
            except ShardnetError as e:
                # name the peer that failed, or the hop before us would blame us when we close
                await reply_error(up, s, "next_hop", f"sending to the next hop failed: {e}",
                                   n=msg["n"], peer=down.remote_peer)
                return


async def _relay_errors(s: bytes, down: MessageStream, up: MessageStream, scope: trio.CancelScope) -> None:
    """Errors from further down the chain travel back up, hop by hop (any other message ends the
    session: frames only flow one way on each stream). Runs for the session's
    life (the step loop's idle timeout bounds that), so it waits without a deadline of its own."""
    try:
        while True:
            msg = await down.recv(FOREVER)
            if msg is None:
                await reply_error(up, s, "next_hop", "next hop closed the stream", peer=down.remote_peer)
                break
            if msg.type == "error":
                await up.send(msg)
                break
            # once ready, only errors travel upstream: anything else is reflected or forged
            await reply_error(up, s, "unexpected", f"the next hop sent {msg.type} upstream", peer=down.remote_peer)
            break
    except (ShardnetError, ap.ActivationProtocolError) as e:
        await reply_error(up, s, "next_hop", f"next hop failed: {e}", peer=down.remote_peer)
    scope.cancel()
