"""Fixes for measured py-libp2p 0.8.1 behaviour that shardnet cannot live with.

Every change to py-libp2p's behaviour lives here, applied once by :func:`apply`, and each one
has a test in ``tests/test_compat.py``. The fixes are deliberately narrow: they replace one
method or one module-level constant each, so they are easy to drop when upstream fixes land.

1. Inbound connections held forever. ``Swarm._do_handle_inbound_connection`` waits for the
   *swarm* to finish instead of the connection, so every inbound connection ever accepted keeps
   a task and an inbound-limit slot: after ~250 connections a node refuses everything.
   Fixed by waiting for that connection's own close event.
2. Yamux resets a stream whose send window stays closed for 5 s (a receiver busy on a long
   forward pass) and polls every 10 ms while it waits. Fixed by an event-driven wait with no
   deadline: the writer sleeps until the window opens or the stream/connection dies
   (flow control, not resets; dead connections are detected by keepalive pings).
3. Fixed ``trio.sleep(0.1)`` calls on the disconnect path (~200 ms per disconnect). They exist
   to force a context switch, which a zero-length sleep also does.
4. gossipsub: per-peer outbound RPC queues of 32 and subscription queues of 32, whose overflow
   is a debug line at most (a burst of 400 publishes delivered 32). Both queues are enlarged and
   every drop, outbound or inbound, is counted (``dropped_pubsub_messages()``) and logged at
   WARNING, naming whether a control message was lost.
5. ``import libp2p`` turns off propagation of its logger: we route it back into ``logging``.

Configuration-level fixes (happy-eyeballs delay, auto-connector watermarks, gossipsub spam
limit and heartbeat, DHT duplicates, SO_REUSEPORT) live where the host is built
(:mod:`shardnet.transport.host`) because they are settings, not patches.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import trio

log = logging.getLogger(__name__)

_applied = False
_pubsub_drops = 0

#: Subscription queue length for gossipsub topics (py-libp2p default: 32).
SUBSCRIPTION_QUEUE_SIZE = 4096
#: Outbound RPC queue length per gossipsub peer (py-libp2p default: 32).
OUTBOUND_QUEUE_SIZE = 4096


def apply() -> None:
    """Apply every fix once. Safe to call many times."""
    global _applied
    if _applied:
        return
    _applied = True
    _route_libp2p_logging()
    _fix_inbound_connection_lifetime()
    _fix_yamux_zero_window_wait()
    _fix_disconnect_sleeps()
    _fix_pubsub_queues()


def dropped_pubsub_messages() -> int:
    """How many gossipsub messages were dropped because a subscriber's queue was full."""
    return _pubsub_drops


# 5. logging ---------------------------------------------------------------------------------
def _route_libp2p_logging() -> None:
    import libp2p  # noqa: F401  (its import is what turns propagation off)

    lg = logging.getLogger("libp2p")
    lg.propagate = True
    # Its own default level hides nothing we want and shows a lot we don't; leave the level to
    # shardnet's logging setup (see shardnet.logs).
    for h in list(lg.handlers):
        lg.removeHandler(h)


# 1. inbound connection lifetime ---------------------------------------------------------------
def _fix_inbound_connection_lifetime() -> None:
    from libp2p.abc import IMuxedConn
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.network.swarm import Swarm

    async def _do_handle_inbound_connection(
        self: Any, read_write_closer: Any, maddr: Any, failure_event: Any
    ) -> None:
        remote_maddr = self._build_remote_multiaddr(read_write_closer)
        if remote_maddr is not None and not await self.connection_gate.is_allowed(remote_maddr):
            log.debug("inbound connection from %s refused by the connection gate", remote_maddr)
            await _close_quietly(read_write_closer)
            return
        raw_conn = None
        try:
            if isinstance(read_write_closer, IMuxedConn):
                muxed = read_write_closer
                await self.add_conn(muxed, direction="inbound")
            else:
                raw_conn = RawConnection(read_write_closer, False)
                muxed = await self.upgrade_inbound_raw_conn(raw_conn, maddr)
        except Exception as e:  # an inbound handshake failing must not hurt the listener
            log.debug("inbound connection on %s failed: %s", maddr, e)
            await _close_quietly(raw_conn if raw_conn is not None else read_write_closer)
            return
        # The listener closes the socket when this handler returns, so stay here exactly as long
        # as this one connection lives (upstream waits for the whole swarm).
        closed = _swarm_conn_closed_event(self, muxed)
        if closed is not None:
            await closed.wait()
        else:
            event_closed = getattr(muxed, "event_closed", None)
            if event_closed is not None:
                await event_closed.wait()

    Swarm._do_handle_inbound_connection = _do_handle_inbound_connection


def _swarm_conn_closed_event(swarm: Any, muxed: Any) -> trio.Event | None:
    for conn in swarm.connections.get(muxed.peer_id, ()):
        if conn.muxed_conn is muxed:
            return conn.event_closed
    return None


async def _close_quietly(closer: Any) -> None:
    try:
        await closer.close()
    except Exception:
        pass


# 2. yamux zero-window wait --------------------------------------------------------------------
def _fix_yamux_zero_window_wait() -> None:
    from libp2p.stream_muxer.exceptions import MuxedStreamError
    from libp2p.stream_muxer.yamux import yamux as ymod

    stream_cls = ymod.YamuxStream

    # Every change to send_window/closed passes through these properties, so a writer waiting
    # for the window can sleep on an event instead of polling against a 5 s deadline.
    def _get_send_window(self: Any) -> int:
        return self.__dict__["_sn_send_window"]

    def _set_send_window(self: Any, value: int) -> None:
        self.__dict__["_sn_send_window"] = value
        if value > 0:
            _wake(self)

    def _get_closed(self: Any) -> bool:
        return self.__dict__.get("_sn_closed", False)

    def _set_closed(self: Any, value: bool) -> None:
        self.__dict__["_sn_closed"] = value
        if value:
            _wake(self)

    stream_cls.send_window = property(_get_send_window, _set_send_window)
    stream_cls.closed = property(_get_closed, _set_closed)

    async def write(self: Any, data: bytes) -> None:
        if self.send_closed:
            raise MuxedStreamError("Stream is closed for sending")
        view = memoryview(data)
        total = len(view)
        sent = 0
        max_payload = ymod.MAX_MESSAGE_SIZE - ymod.HEADER_SIZE
        while sent < total:
            frame = None
            async with self.rw_lock.write_lock():
                if self.send_closed:
                    raise MuxedStreamError("Stream is closed for sending")
                if self.closed:
                    raise MuxedStreamError("Stream is closed")
                window = self.send_window
                if window > 0:
                    n = min(window, max_payload, total - sent)
                    self.send_window = window - n
                    header = ymod.struct.pack(
                        ymod.YAMUX_HEADER_FORMAT, 0, ymod.TYPE_DATA, 0, self.stream_id, n
                    )
                    frame = header + view[sent : sent + n].tobytes()
            if frame is None:
                await _wait_for_window(self)
                continue
            await self.conn._write_frame(frame)
            sent += len(frame) - ymod.HEADER_SIZE

    stream_cls.write = write


def _wake(stream: Any) -> None:
    ev = stream.__dict__.get("_sn_window_event")
    if ev is not None:
        ev.set()


async def _wait_for_window(stream: Any) -> None:
    """Sleep until the peer opens the window or the stream or its connection goes away."""
    while stream.send_window <= 0 and not stream.closed:
        ev = trio.Event()
        stream.__dict__["_sn_window_event"] = ev
        conn_closed = getattr(stream.conn, "event_closed", None)
        # The connection's close does not always mark each stream closed first: look at it
        # every second so a writer never outlives its connection.
        with trio.move_on_after(1.0):
            await ev.wait()
        if conn_closed is not None and conn_closed.is_set():
            from libp2p.stream_muxer.exceptions import MuxedStreamError

            raise MuxedStreamError("connection closed while waiting for the send window")


# 3. disconnect sleeps -------------------------------------------------------------------------
class _TrioWithoutCleanupNaps(types.ModuleType):
    """``trio`` as seen by two py-libp2p modules, minus their fixed 100 ms cleanup naps."""

    def __init__(self) -> None:
        super().__init__("trio")

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)

    @staticmethod
    async def sleep(seconds: float) -> None:
        # 0.1 s is only ever used on their close paths "to force a context switch".
        await trio.sleep(0 if seconds == 0.1 else seconds)


def _fix_disconnect_sleeps() -> None:
    from libp2p.network.connection import swarm_connection
    from libp2p.stream_muxer.yamux import yamux as ymod

    proxy = _TrioWithoutCleanupNaps()
    swarm_connection.trio = proxy
    ymod.trio = proxy


# 4. pubsub queues -----------------------------------------------------------------------------
def _fix_pubsub_queues() -> None:
    from libp2p.pubsub import gossipsub as gmod
    from libp2p.pubsub import pubsub as pmod
    from libp2p.pubsub import rpc_queue as qmod

    pmod.SUBSCRIPTION_CHANNEL_SIZE = SUBSCRIPTION_QUEUE_SIZE
    # The default is bound at definition time, so the module constant alone changes nothing.
    defaults = list(qmod.RpcQueue.__init__.__defaults__)
    defaults[0] = OUTBOUND_QUEUE_SIZE
    qmod.RpcQueue.__init__.__defaults__ = tuple(defaults)

    def drop_rpc(peer_id: Any, rpc: Any) -> None:
        global _pubsub_drops
        _pubsub_drops += 1
        log.warning(
            "pubsub: outbound queue to %s is full (%d RPCs); dropped an RPC with %d message(s)%s "
            "(%d dropped so far)",
            peer_id, OUTBOUND_QUEUE_SIZE, len(rpc.publish),
            " and CONTROL messages" if rpc.HasField("control") else "", _pubsub_drops,
        )

    pmod.drop_rpc = drop_rpc
    gmod.drop_rpc = drop_rpc

    def notify_subscriptions(self: Any, publish_message: Any) -> None:
        global _pubsub_drops
        for topic in publish_message.topicIDs:
            if topic not in self.topic_ids:
                continue
            try:
                self.subscribed_topics_send[topic].send_nowait(publish_message)
            except trio.WouldBlock:
                _pubsub_drops += 1
                log.warning(
                    "pubsub: subscriber of %r is %d messages behind; dropped one (%d dropped so far)",
                    topic,
                    SUBSCRIPTION_QUEUE_SIZE,
                    _pubsub_drops,
                )

    pmod.Pubsub.notify_subscriptions = notify_subscriptions
