"""The trio driver of ``/shardnet/activation/1.0.0``: carries codec messages over a Stream.

The codec and the session rules are I/O-free (``activation.py``); this module only feeds the
bytes a stream reads into the decoder and writes encoded frames out, under deadlines.
"""

from __future__ import annotations

import logging

from collections.abc import Sequence

import trio

from shardnet.errors import InferenceError
from shardnet.protocols import activation as ap
from shardnet.protocols.activation import ErrorCode
from shardnet.protocols.activation_session import ReplyError
from shardnet.protocols.receipts import HashChain
from shardnet.transport.config import peer_info
from shardnet.transport.errors import ShardnetError
from shardnet.transport.limits import Refusals
from shardnet.transport.node import Node
from shardnet.transport.stream import Stream

log = logging.getLogger(__name__)

OPEN_TIMEOUT = 30.0
STEP_TIMEOUT = 120.0
#: for waits another deadline bounds (a session's idle timeout): no deadline of their own
FOREVER = 10 * 365 * 86400.0


class MessageStream:
    """A Stream carrying activation-protocol messages."""

    def __init__(self, stream: Stream, max_frame: int = ap.DEFAULT_MAX_FRAME) -> None:
        self.stream = stream
        self.decoder = ap.ActivationDecoder(max_frame)
        self.pending: list[ap.Message] = []
        self._send_lock = trio.Lock()
        #: hash chains over the frames sent / taken from this stream, when a receipt needs them
        self.sent_hash: HashChain | None = None
        self.received_hash: HashChain | None = None

    @property
    def remote_peer(self) -> str:
        return str(self.stream.remote_peer)

    async def send(self, msg: ap.Message) -> None:
        data = ap.encode(msg)
        async with self._send_lock:
            if self.sent_hash is not None:
                self.sent_hash.add(data[4:])  # the frame without its length prefix, as the receiver sees it
            await self.stream.write(data, timeout=STEP_TIMEOUT)

    async def recv(self, timeout: float) -> ap.Message | None:
        """Next message, or None at end of stream. Raises ActivationProtocolError on bad input."""
        with trio.fail_after(timeout):
            while not self.pending:
                data = await self.stream.read_some(1 << 20, timeout=timeout)
                if not data:
                    if self.decoder.pending:
                        raise ap.ActivationProtocolError("malformed", "stream ended inside a frame")
                    return None
                self.pending.extend(self.decoder.feed(data))
        msg = self.pending.pop(0)
        if self.received_hash is not None:
            self.received_hash.add(msg.raw)
        return msg

    def observed(self) -> str:
        """The address this stream's peer is seen at (for receipts)."""
        if self.stream.relayed:
            return "relayed"
        try:
            host, port = self.stream.raw.get_remote_address()
            return f"{host}:{port}"
        except Exception:
            return "unknown"

    async def close(self) -> None:
        await self.stream.close()


async def open_hop(node: Node, peer: str, addrs: Sequence[str], first: ap.Message, *,
                   reply_timeout: float | None, sent_hash: HashChain | None = None
                   ) -> tuple[MessageStream, ap.Message | None]:
    """A stream to the next hop of a chain: dial ``peer``, open an activation stream, send
    ``first`` (an ``open`` for the rest of the chain, or a last hop's ``attach``) and, unless
    ``reply_timeout`` is None, read the reply (None: the stream ended first). ``sent_hash``
    hashes the frames sent, for a receipt.

    A peer that cannot be reached, or goes away meanwhile (a reset, its connection lost), raises
    InferenceError ``next_hop`` naming it; a bad frame from it raises ActivationProtocolError and
    no reply in time trio.TooSlowError, as they are (they are not a lost connection). On any of
    these the stream is closed. Whether the reply is ``ready`` is the caller's session machine's
    to say."""
    try:
        await node.connect(peer_info(peer, list(addrs)))
        ms = MessageStream(await node.new_stream(peer, ap.PROTOCOL_ID))
    except ShardnetError as e:
        raise InferenceError(ErrorCode.NEXT_HOP, f"cannot reach {peer[:16]}…: {e}", peer) from None
    ms.sent_hash = sent_hash
    try:
        await ms.send(first)
        return ms, (None if reply_timeout is None else await ms.recv(reply_timeout))
    except BaseException as e:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                await ms.close()
            except ShardnetError:
                pass
        if isinstance(e, ShardnetError) and not isinstance(e, ap.ActivationProtocolError):
            raise InferenceError(ErrorCode.NEXT_HOP, f"{peer[:16]}… failed: {e}", peer) from None
        raise


async def reply_error(ms: MessageStream, session: bytes, code: str, msg: str, n: int | None = None,
                      peer: str | None = None, **figures: int | float) -> None:
    """Send an ``error`` on ``ms``, best effort (the stream may already be gone). ``figures``:
    a busy refusal's ``need_bytes``, ``limit_bytes``, ``retry_after_s`` (see ``ap.Error``)."""
    _error_replies.note(code, ms.remote_peer, f"error reply to {ms.remote_peer[:16]}: {code}: {msg}")
    with trio.move_on_after(5):
        try:
            await ms.send(ap.Error(session, code, msg, n, peer, **figures))
        except ShardnetError:
            pass


async def send_reply(ms: MessageStream, reply: ReplyError) -> None:
    """Carry out a session machine's ``ReplyError``."""
    await reply_error(ms, reply.session, reply.code, reply.message, reply.n, reply.peer)


#: a peer sending garbage gets an error reply per stream, and the log one line per 10 s
_error_replies = Refusals(log, logging.INFO)
