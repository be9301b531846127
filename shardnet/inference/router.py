"""The activation protocol's handler on a node: one per node, shared by its roles.

A stream whose first message is ``open`` is a session for the block this node serves (handed to
the server role that registered ``on_open``); one whose first message is ``attach`` is the last
hop of a chain returning results straight to a client session of this node (accepted only from
the peer that session expects). The client and the server never import each other: both talk to
this router.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from shardnet.protocols import activation as ap
from shardnet.protocols.activation import ErrorCode
from shardnet.protocols.activation_io import MessageStream, reply_error
from shardnet.protocols.receipts import HashChain
from shardnet.transport.behaviour import Behaviour
from shardnet.transport.node import Node
from shardnet.transport.stream import Stream

OpenHandler = Callable[[MessageStream, ap.Open], Awaitable[None]]


class ActivationRouter(Behaviour):
    def __init__(self, node: Node) -> None:
        self.node = node
        self.limits = node.config.limits
        self.on_open: OpenHandler | None = None
        self._returns: dict[bytes, tuple[str, trio.MemorySendChannel]] = {}
        node.set_stream_handler(ap.PROTOCOL_ID, self._handle)

    @classmethod
    def of(cls, node: Node) -> ActivationRouter:
        """The node's router (a behaviour: its handler is registered on first use)."""
        return node.ensure_behaviour(cls)

    # -- client side: waiting for the chain's direct return ------------------------------------
    def expect_return(self, session: bytes, from_peer: str) -> trio.MemoryReceiveChannel:
        send, recv = trio.open_memory_channel[MessageStream](1)
        self._returns[session] = (from_peer, send)
        return recv

    def forget_return(self, session: bytes) -> None:
        entry = self._returns.pop(session, None)
        if entry:
            entry[1].close()

    # -- every incoming activation stream ------------------------------------------------------
    async def _handle(self, stream: Stream) -> None:
        ms = MessageStream(stream, self.limits.activation_frame_bytes)
        try:
            first = await ms.recv(self.limits.first_frame_s)
        except trio.TooSlowError:
            await reply_error(ms, b"\0" * ap.SESSION_ID_BYTES, ErrorCode.TIMEOUT,
                              f"no complete first frame within {self.limits.first_frame_s:g} s")
            return
        except ap.ActivationProtocolError as e:
            await reply_error(ms, b"\0" * ap.SESSION_ID_BYTES, e.code, e.message)
            return
        if first is None:
            return
        if isinstance(first, ap.Attach):
            await self._accept_return(ms, first)
        elif isinstance(first, ap.Open):
            if self.on_open is None:
                await reply_error(ms, first.session, ErrorCode.NO_BLOCK, "this peer serves no block")
                return
            await self.on_open(ms, first)
        else:
            await reply_error(ms, first.session, ErrorCode.UNEXPECTED, f"a session starts with open, not {first.type}")

    async def _accept_return(self, ms: MessageStream, first: ap.Attach) -> None:
        entry = self._returns.get(first.session)
        if entry is None or entry[0] != ms.remote_peer:
            await reply_error(ms, first.session, ErrorCode.UNKNOWN_SESSION,
                              "no session of ours expects this return stream")
            return
        ms.received_hash = HashChain()  # the client's side of the last hop's receipt
        ms.received_hash.add(first.raw)
        done = trio.Event()
        ms.done = done  # the client session sets it when finished with the stream
        try:
            entry[1].send_nowait(ms)
        except (trio.WouldBlock, trio.ClosedResourceError):
            await reply_error(ms, first.session, ErrorCode.UNKNOWN_SESSION, "return stream already attached")
            return
        await done.wait()  # keep the handler (and so the stream) alive while the client reads it
