"""Patches to py-libp2p's Yamux muxer (``libp2p.stream_muxer.yamux``).

2. Yamux resets a stream whose send window stays closed for 5 s (a receiver busy on a long
   forward pass) and polls every 10 ms while it waits. Fixed by an event-driven wait with no
   deadline: the writer sleeps until the window opens or the stream/connection dies
   (flow control, not resets; dead connections are detected by keepalive pings).
3. Fixed ``trio.sleep(0.1)`` calls on the disconnect path (here in Yamux's module; swarm.py
   installs the same proxy in swarm_connection's).
6. Data path speed (untuned: ~0.1x raw TCP throughput, ~8x raw round trip). The wire format is
   unchanged (interoperable Yamux); only how py-libp2p produces and parses it (off with
   SHARDNET_UNTUNED_DATA_PATH=1; noise.py has the Noise and secure-session half):
   - A Yamux stream write sends every frame its window allows in one secure-session write, and
     Yamux's per-frame debug formatting (built even when debug logging is off) is skipped.
   - Frames of 256 KiB instead of 64 KiB to peers that advertise LARGE_FRAMES_PROTOCOL (other
     shardnet nodes), since the receiving side's cost is mostly per frame.
   - Stream receive buffers are chunk queues: upstream's ``del bytearray[:n]`` per read made
     reading quadratic in the amount buffered (throughput halved whenever the window grew).
   - Window updates follow go-yamux (credit when half the target window is owed) from a 2 MiB
     initial target, instead of one WINDOW_UPDATE frame per read.
   - Yamux's locks take a free lock without a scheduler round trip.
10. Yamux pings each connection every 30 s to measure its round trip and only notes a missing
   answer, so a connection whose path died silently (a NAT forgot the mapping, a relay or a
   router vanished) looks alive until TCP gives up, many minutes later. The ping interval is now
   the node's ``keepalive_interval`` (``set_keepalive_interval``), and the node closes a
   connection whose last ping went unanswered for ``keepalive_timeout`` (node.py, through
   ``unanswered_ping_age``), which is what starts reconnection.
   Only a quiet connection is pinged: one that brought nothing for a whole interval. Whatever
   arrives (a frame of any stream, the other side's ping or its answer) shows the path alive,
   so a connection carrying traffic sends no pings, and on an idle one the two sides take
   turns instead of both pinging every interval (upstream: two pings and two answers per
   interval per connection, which at 24 idle peers was a fifth of each peer's socket reads).
   A path that dies is still found within an interval and the ping's timeout. And the interval
   grows while no long-lived stream writes on a connection (half the time since one last wrote,
   from ``keepalive_interval`` up to ``keepalive_max_interval``, 300 s; the longest on a
   connection none ever wrote on): an idle swarm's peers hold a connection to each of their
   neighbours, and pinging each every 10 s (later 60 s) was the largest share of an idle peer's
   messages (docs/performance.md). Long-lived: open for an interval or more (a session, a
   gossip link); requests and their answers (DHT queries, claim fetches) do not count, or each
   one brought a connection back to 10 s and ~9 pings before it was quiet again. Nor do gossip
   links' writes (``GOSSIP_PROTOCOLS``, marked when the stream's protocol is set): gossipsub's
   mesh upkeep sends a control message down some link every heartbeat, and each one brought a
   connection back to 10 s (an idle 24-peer swarm's peer sent 1.2 pings a second, one per
   connection every ~20 s, measured by the profile of docs/performance.md); a connection that
   carries gossip alone is pinged as an idle one, so its silent death is found within the longest
   interval and the timeout (before: ~10-20 s). A silently
   dead idle connection is found within the longer interval and the timeout; one whose
   sessions write keeps the short one. Behind NAT the longest interval is 60 s (keepalive.py:
   a NAT may drop an idle TCP mapping sooner than RFC 5382's 2 h 4 min, and it is our side's
   packets that keep it).
15. Cancelled writes broke connections. Yamux frames were encrypted and written by whichever task
   wrote to a stream; a cancellation (a step timeout, a heal, a client hanging up) landing inside
   the socket write left a Noise message half sent after its nonce was consumed, so the peer's
   next decryption failed ("Failed authentication of message") and every stream on that
   connection died (measured: 23 of 28 writes cut midway killed the connection). Each Yamux
   connection now has one writer task (conn_writer.py) fed by a queue; only it encrypts and
   writes. A cancelled stream write abandons what it had not queued, and if it had queued part
   of its data it resets its own stream; the connection is never touched. And a reader whose
   stream was reset sees the reset once the bytes before it are read (upstream forgot the stream
   and reported a clean end, passing a truncated message off as whole), while a stream whose FIN
   came before its reset reads to a clean end. With SHARDNET_UNTUNED_DATA_PATH=1 (upstream's
   stream write, for benchmarks) frames still go through the writer whole, but a write cut
   midway does not reset its stream.
17. A connection lets this node open 256 streams (``Yamux.stream_backlog_limit``); a stream keeps
   its slot until it is closed or reset *here*, even once the peer has closed its half (it may
   still be written to). An app that never closes its streams found its 257th open waiting
   silently for a slot, until its own deadline (10 s). Now the open fails at once with
   StreamLimitError naming the limit and how many of the streams holding it the peer had closed,
   and the refusal is logged here (one line per peer every 10 s). Released streams are upstream's:
   closed or reset here, or reset by the peer.
21. Each connection's stale-stream sweeper woke every 30 s whatever the connection carried: at
   24 idle peers 0.8 wakeups a second per peer, 5 % of an idle peer's profile. It only reclaims
   streams fully closed with unread data (a normal close forgets a stream at once), so it now
   sleeps ``IDLE_SWEEP_FACTOR`` (10) intervals while no closed stream is left on the connection,
   one while one is (such a stream is reclaimed at most 300 s later than before).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import trio

from ..behaviour import wait_any
from .naps import TrioWithoutCleanupNaps

log = logging.getLogger(__name__)


# 10. keepalive --------------------------------------------------------------------------------
#: Seconds between pings on a connection that opened no stream for a long while (set with the
#: interval; ``keepalive_max_interval`` in a node's config).
QUIET_MAX_INTERVAL = 300.0


def set_keepalive_interval(seconds: float, longest: float | None = None) -> None:
    """Seconds between Yamux pings on every connection of this process: ``seconds`` on one that
    wrote on a stream lately, growing to ``longest`` (at least ``seconds``) on one that stays quiet."""
    global QUIET_MAX_INTERVAL
    from libp2p.stream_muxer.yamux import yamux

    yamux.RTT_MEASURE_INTERVAL = seconds
    QUIET_MAX_INTERVAL = max(seconds, QUIET_MAX_INTERVAL if longest is None else longest)


def note_when_each_connection_last_heard() -> None:
    from libp2p.security.secure_session import SecureSession

    read = SecureSession.read

    async def read_noting_the_time(self: Any, n: int | None = None) -> bytes:
        data = await read(self, n)
        self.__dict__["_sn_heard"] = trio.current_time()
        return data

    SecureSession.read = read_noting_the_time


def heard_at(muxed: Any) -> float | None:
    """When the connection last brought anything (trio time), or None where not noted."""
    return getattr(getattr(muxed, "secured_conn", None), "__dict__", {}).get("_sn_heard")


def used_at(muxed: Any) -> float | None:
    """When a stream last wrote on the Yamux connection, this side (trio time), or None."""
    return getattr(muxed, "__dict__", {}).get("_sn_used_at")


def ping_interval(muxed: Any, now: float) -> float:
    """Seconds between pings on ``muxed`` now: the keepalive interval while a long-lived stream
    of it writes (``note_when_each_connection_last_used``), then half the time since one last
    wrote, up to ``QUIET_MAX_INTERVAL``; that longest interval on a connection no long-lived
    stream ever wrote on."""
    from libp2p.stream_muxer.yamux import yamux as ymod

    base = ymod.RTT_MEASURE_INTERVAL
    longest = max(base, QUIET_MAX_INTERVAL)
    used = used_at(muxed)
    if used is None:
        return longest
    return min(longest, max(base, (now - used) / 2))


#: protocols of gossip links: long-lived streams whose writes are the swarm's upkeep, not a use of
#: the connection (they do not shorten its keepalive interval; connmgr.py: nor make it busy)
GOSSIP_PROTOCOLS = ("/meshsub/", "/floodsub/")


def note_gossip_streams() -> None:
    from libp2p.network.stream.net_stream import NetStream

    set_protocol = NetStream.set_protocol

    def set_protocol_noting_gossip(self: Any, protocol_id: Any) -> None:
        set_protocol(self, protocol_id)
        if str(protocol_id).startswith(GOSSIP_PROTOCOLS):
            getattr(self.muxed_stream, "__dict__", {})["_sn_gossip"] = True

    NetStream.set_protocol = set_protocol_noting_gossip


def note_when_each_connection_last_used() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    stream_write = ymod.YamuxStream.write

    async def write(self: Any, data: bytes) -> None:
        # Only a stream that has lived an interval counts (a session, a gossip link): a request
        # and its answer (a DHT query, a claim fetch) pass in well under one, and when each
        # one brought the interval back to 10 s, an idle 24-peer swarm's rare DHT traffic had
        # every connection pinged ~9 times after it (docs/performance.md)
        now = trio.current_time()
        if now - self.__dict__.setdefault("_sn_born", now) >= ymod.RTT_MEASURE_INTERVAL and \
                not self.__dict__.get("_sn_gossip"):
            state = self.conn.__dict__
            used = state.get("_sn_used_at")
            state["_sn_used_at"] = now
            if used is None or now - used > 2 * ymod.RTT_MEASURE_INTERVAL:
                wake_keepalive(self.conn)  # it may be asleep on a long interval: the short one now
        await stream_write(self, data)

    ymod.YamuxStream.write = write


def ping_only_quiet_connections() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    async def _measure_rtt_loop(self: Any) -> None:
        await trio.sleep(0.5)  # upstream's: let the connection establish; the first ping measures its RTT
        must_ping = True
        rng = random.Random()
        while not self.event_shutting_down.is_set():
            interval = ping_interval(self, trio.current_time())
            heard = heard_at(self)
            if heard is None:  # not noted (another secure channel): from our last ping, as upstream
                heard = self._ping_sent_time
            # Each side waits a random 75-100 % of the interval after what it last heard, so the one
            # whose wait ends first pings and the other hears that before its own wait ends (equal
            # waits would have both ping at once, each before the other's ping arrived).
            quiet_until = heard + interval * rng.uniform(0.75, 1.0)
            if not must_ping and trio.current_time() < quiet_until:
                self.__dict__["_sn_wake"] = wake = trio.Event()  # a long-lived stream began writing
                with trio.move_on_after(quiet_until - trio.current_time()):
                    await wait_any(self.event_shutting_down, wake)
                if self.event_shutting_down.is_set():
                    break
                if (heard_at(self) or heard) != heard or wake.is_set():
                    continue  # heard something meanwhile, or the interval shrank: wait again from then
            must_ping = False
            try:
                self._ping_id += 1
                # the ping's age counts from now, while its write may wait for the writer's queue
                # (keepalive reads it: an older ping's time would make a live connection look dead)
                self._ping_sent_time = trio.current_time()
                self._ping_event = trio.Event()
                header = ymod.struct.pack(ymod.YAMUX_HEADER_FORMAT, 0, ymod.TYPE_PING, ymod.FLAG_SYN, 0,
                                          self._ping_id)
                await self._write_frame(header)
                self._ping_sent_time = trio.current_time()
                with trio.move_on_after(10.0):  # upstream's wait for the answer
                    await self._ping_event.wait()
            except Exception:
                break  # the connection is closing
            if not self._ping_event.is_set():  # unanswered: the next ping an interval on, as upstream
                with trio.move_on_after(ymod.RTT_MEASURE_INTERVAL):
                    await self.event_shutting_down.wait()

    ymod.Yamux._measure_rtt_loop = _measure_rtt_loop


def wake_keepalive(muxed: Any) -> None:
    """Have the keepalive loop of ``muxed`` look at its interval again now (it changed)."""
    wake = getattr(muxed, "__dict__", {}).get("_sn_wake")
    if wake is not None:
        wake.set()


def pings_sent(muxed: Any) -> int:
    """Keepalive pings this side of a Yamux connection has sent."""
    return getattr(muxed, "_ping_id", 0)


def unanswered_ping_age(muxed: Any) -> float | None:
    """Seconds since the connection's last ping was sent if no answer came yet (None: answered,
    none sent yet, or not a Yamux connection)."""
    event, sent = getattr(muxed, "_ping_event", None), getattr(muxed, "_ping_sent_time", 0.0)
    if event is None or not sent or event.is_set():
        return None
    return trio.current_time() - sent


# 21. idle connections' upkeep ----------------------------------------------------------------
#: how many sweep intervals (30 s upstream) the stale-stream sweeper of a connection sleeps while
#: none of its streams waits to be reclaimed
IDLE_SWEEP_FACTOR = 10


def sweep_only_while_a_closed_stream_waits() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    async def _stale_stream_sweeper(self: Any) -> None:
        # Upstream woke every connection's sweeper every 30 s (at 24 idle peers, 0.8 wakeups a
        # second per peer for nothing): a stream is only ever left to the sweeper when it was
        # fully closed with unread data (the normal close forgets it at once), so while no
        # closed stream is left the sweeper sleeps IDLE_SWEEP_FACTOR times longer.
        while not self.event_shutting_down.is_set():
            waiting = any(stream.closed for stream in self.streams.values())
            with trio.move_on_after(ymod._STALE_STREAM_SWEEP_INTERVAL * (1 if waiting else IDLE_SWEEP_FACTOR)):
                await self.event_shutting_down.wait()
            if self.event_shutting_down.is_set():
                break
            async with self.streams_lock:
                self._sweep_stale_streams()

    ymod.Yamux._stale_stream_sweeper = _stale_stream_sweeper


# 2. yamux zero-window wait --------------------------------------------------------------------
# Every change to send_window/closed passes through these properties, so a writer waiting
# for the window can sleep on an event instead of polling against a 5 s deadline.
def wake_writers_when_the_window_opens() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    def _get_send_window(self: Any) -> int:
        return self.__dict__["_sn_send_window"]

    def _set_send_window(self: Any, value: int) -> None:
        self.__dict__["_sn_send_window"] = value
        if value > 0:
            _wake(self)

    ymod.YamuxStream.send_window = property(_get_send_window, _set_send_window)


def wake_writers_when_the_stream_closes() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    def _get_closed(self: Any) -> bool:
        return self.__dict__.get("_sn_closed", False)

    def _set_closed(self: Any, value: bool) -> None:
        self.__dict__["_sn_closed"] = value
        if value:
            _wake(self)

    ymod.YamuxStream.closed = property(_get_closed, _set_closed)


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
def skip_yamux_naps() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    ymod.trio = TrioWithoutCleanupNaps()


# 6. data path ---------------------------------------------------------------------------------
#: Largest Yamux DATA frame sent to an arbitrary peer: 64 KiB, as go-yamux and js-libp2p write.
YAMUX_DEFAULT_FRAME = 64 * 1024
#: Largest frame sent to a peer that advertises LARGE_FRAMES_PROTOCOL (shardnet nodes: py-libp2p
#: accepts DATA frames up to the receive window). The receiver's cost is mostly per frame, so
#: 256 KiB frames roughly double a stream's throughput.
YAMUX_LARGE_FRAME = 256 * 1024
#: Advertised (through identify's protocol list) by every shardnet node; never opened.
LARGE_FRAMES_PROTOCOL = "/shardnet/cap/yamux-frames-256k/1.0.0"

_peerstores: list[Any] = []


def register_peerstore(peerstore: Any) -> None:
    """Let the Yamux writer look up what a remote peer advertises (its large-frame capability)."""
    import weakref

    _peerstores[:] = [r for r in _peerstores if r() is not None]
    _peerstores.append(weakref.ref(peerstore))


def _max_frame_for(conn: Any) -> int:
    cached = conn.__dict__.get("_sn_max_frame")
    if cached is not None:
        return cached
    peer_id = getattr(conn, "peer_id", None)
    for ref in _peerstores:
        ps = ref()
        if ps is not None and peer_id is not None and ps.supports_protocols(peer_id, [LARGE_FRAMES_PROTOCOL]):
            conn.__dict__["_sn_max_frame"] = YAMUX_LARGE_FRAME
            return YAMUX_LARGE_FRAME
    return YAMUX_DEFAULT_FRAME  # not cached: identify may still tell us more
#: Receive window a stream grants its sender from its first read on (spec initial: 256 KiB).
YAMUX_INITIAL_TARGET_WINDOW = 2 << 20
#: Seconds to wait for the rest of a DATA frame whose header has arrived (upstream: 60).
YAMUX_BODY_TIMEOUT = 60.0
#: Most bytes one stream write hands to the secure session at once.
YAMUX_MAX_BATCH = 1 << 20


def batch_stream_writes() -> None:
    from libp2p.stream_muxer.exceptions import MuxedStreamError, MuxedStreamReset
    from libp2p.stream_muxer.yamux import yamux as ymod

    from ..conn_writer import WriterClosed

    header = ymod.struct.Struct(ymod.YAMUX_HEADER_FORMAT)

    async def write(self: Any, data: bytes) -> None:
        view = memoryview(data)
        total = len(view)
        sent = 0  # bytes handed to the connection's writer: those go out whole, come what may
        conn = self.conn
        writer = conn._sn_writer
        try:
            while sent < total:
                if self.send_closed:
                    raise MuxedStreamError("Stream is closed for sending")
                if self.closed:
                    raise MuxedStreamError("Stream is closed")
                if self.send_window <= 0:
                    await _wait_for_window(self)
                    continue
                await writer.wait_for_room(min(self.send_window, total - sent, YAMUX_MAX_BATCH))
                budget = min(self.send_window, total - sent, YAMUX_MAX_BATCH)
                if budget <= 0 or self.send_closed or self.closed:
                    continue
                # From here to push() nothing awaits: frames of concurrent writers on one
                # connection never interleave inside a batch, and stay in order.
                max_frame = _max_frame_for(conn)
                batch = bytearray()
                pos, end = sent, sent + budget
                while pos < end:
                    n = min(max_frame, end - pos)
                    batch += header.pack(0, ymod.TYPE_DATA, 0, self.stream_id, n)
                    batch += view[pos : pos + n]
                    pos += n
                writer.push(batch)
                self.send_window -= budget
                sent = end
            # Queued is as good as sent (like bytes in a socket's buffer): the write returns
            # without waiting on the writer, a round of task switches less per message, and the
            # queue's bound is the backpressure. A failed connection shows on the next call.
            await trio.lowlevel.cancel_shielded_checkpoint()
        except WriterClosed as e:
            raise MuxedStreamReset(f"connection lost: {e}") from None
        except BaseException:
            if 0 < sent < total:
                # Part of this write is committed and the rest never will be: the peer must see
                # a reset, not a message that silently stops short.
                await _reset_cut_stream(self)
            raise

    ymod.YamuxStream.write = write


def update_windows_like_go_yamux() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    async def _auto_tune_and_send_window_update(self: Any, *, bytes_read: int = 0) -> None:
        # go-yamux's sendWindowUpdate: credit the window back only once at least half the
        # target is owed. Upstream also credited every read's bytes at once ("release on
        # read", "partial slack"): one WINDOW_UPDATE frame per small message, doubling the
        # frames of a request/response exchange.
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        delta = self.target_recv_window - (self.recv_window + buffered)
        if delta <= 0 or delta < self._grow_threshold():
            return
        total = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
        self._pending_recv_release = 0
        if total > 0:
            await self.send_window_update(total, skip_lock=True)

    ymod.YamuxStream._auto_tune_and_send_window_update = _auto_tune_and_send_window_update


def start_streams_with_a_larger_window() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    orig_init = ymod.YamuxStream.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        # Start from a larger target than the spec's 256 KiB initial window (granted to the
        # sender by the first window update); auto-tuning still grows it toward 16 MiB on long
        # paths. 256 KiB in flight caps a loopback stream at the speed of one update round trip.
        self.target_recv_window = YAMUX_INITIAL_TARGET_WINDOW
        self.window_lock = _FastLock()

    ymod.YamuxStream.__init__ = __init__


def chunk_buffers_and_fast_locks() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    orig_conn_init = ymod.Yamux.__init__

    def conn_init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_conn_init(self, *args, **kwargs)
        self.streams_lock = _FastLock()
        self.stream_buffers = _ChunkBufferDict(self.stream_buffers)

    ymod.Yamux.__init__ = conn_init


def read_streams_without_lock_or_debug_strings() -> None:
    from libp2p.stream_muxer.exceptions import MuxedStreamEOF, MuxedStreamReset
    from libp2p.stream_muxer.yamux import yamux as ymod

    async def read_stream(self: Any, stream_id: int, n: int = -1) -> bytes:
        # Upstream's logic without its lock (the checks never await) and without the five
        # debug strings it formats on every call.
        if n is None:
            n = -1
        while True:
            stream = self.streams.get(stream_id)
            if stream is None:
                raise MuxedStreamEOF("Stream closed")
            if self.event_shutting_down.is_set():
                raise MuxedStreamEOF("Connection shut down")
            buffer = self.stream_buffers.get(stream_id)
            if buffer is None:
                if stream.reset_received:
                    raise MuxedStreamReset("Stream was reset")
                raise MuxedStreamEOF("Stream buffer closed")
            if buffer:
                data = buffer.take(n)
                if stream.closed and not buffer:
                    async with self.streams_lock:
                        if self.streams.get(stream_id) is stream:
                            self._finalize_stream_locked(stream, fully_closed=True)
                return data
            if stream.reset_received:
                raise MuxedStreamReset("Stream was reset")
            if stream.recv_closed:
                raise MuxedStreamEOF("Stream is closed for receiving")
            if stream.closed:
                raise MuxedStreamReset("Stream is reset or closed")
            try:
                await self.stream_events[stream_id].wait()
                self.stream_events[stream_id] = trio.Event()
            except KeyError:
                raise MuxedStreamEOF("Stream was removed") from None

    ymod.Yamux.read_stream = read_stream


def read_small_frame_bodies_from_the_session_buffer() -> None:
    from libp2p.io.exceptions import IncompleteReadError
    from libp2p.stream_muxer.yamux import yamux as ymod

    orig_read_body = ymod.Yamux._read_data_body

    async def _read_data_body(self: Any, length: int) -> bytes:
        # A small frame's body usually arrived in the same Noise message as its header: take it
        # from the session buffer without building a deadline scope (and reading an
        # environment variable for its length) per frame.
        buf = self.secured_conn.__dict__.get("_sn_buf")
        if buf is None:
            return await orig_read_body(self, length)
        if len(buf) >= length:
            out = bytes(buf[:length])
            del buf[:length]
            return out
        # A large frame spans several Noise messages: gather them and join once.
        parts: list[bytes] = []
        remaining = length
        with trio.fail_after(YAMUX_BODY_TIMEOUT):
            while remaining > 0:
                part = await self.secured_conn.read(remaining)
                if not part:
                    raise IncompleteReadError(
                        f"connection closed inside a {length}-byte frame",
                        expected_bytes=length, received_bytes=length - remaining,
                    )
                parts.append(part)
                remaining -= len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    ymod.Yamux._read_data_body = _read_data_body


class _ChunkBuffer:
    """A stream's receive buffer as a queue of chunks.

    Yamux kept each stream's unread bytes in one bytearray and consumed it with
    ``del buf[:n]``: a memmove of everything still buffered on every read, quadratic once
    auto-tuning lets megabytes pile up (a 1 MiB reader behind a 16 MiB window copied ~8 MiB per
    read). Supports exactly the operations Yamux uses on its buffers.
    """

    __slots__ = ("_chunks", "_len")

    def __init__(self) -> None:
        from collections import deque

        self._chunks: Any = deque()
        self._len = 0

    def extend(self, data: bytes) -> None:
        if data:
            self._chunks.append(data if isinstance(data, bytes) else bytes(data))
            self._len += len(data)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def clear(self) -> None:
        self._chunks.clear()
        self._len = 0

    def take(self, n: int = -1) -> bytes:
        """Remove and return up to ``n`` bytes from the front (all if n < 0)."""
        chunks = self._chunks
        if n < 0 or n >= self._len:
            out = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self.clear()
            return out
        parts = []
        need = n
        while need:
            head = chunks[0]
            if len(head) <= need:
                parts.append(chunks.popleft())
                need -= len(head)
            else:
                parts.append(head[:need])
                chunks[0] = head[need:]
                need = 0
        self._len -= n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def __bytes__(self) -> bytes:
        return b"".join(self._chunks)

    def __getitem__(self, key: slice) -> bytes:
        if not isinstance(key, slice) or key.start not in (None, 0) or key.step not in (None, 1):
            raise TypeError("only buf[:n] is supported")
        stop = self._len if key.stop is None else min(key.stop, self._len)
        parts, have = [], 0
        for chunk in self._chunks:  # only as many chunks as the slice needs
            if have >= stop:
                break
            parts.append(chunk[: stop - have])
            have += len(parts[-1])
        return b"".join(parts)

    def __delitem__(self, key: slice) -> None:
        if not isinstance(key, slice) or key.start not in (None, 0) or key.step not in (None, 1):
            raise TypeError("only del buf[:n] is supported")
        self.take(self._len if key.stop is None else key.stop)


class _ChunkBufferDict(dict):
    """Yamux's per-stream buffer table: each ``bytearray()`` it stores becomes a _ChunkBuffer."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, bytearray):
            chunked = _ChunkBuffer()
            chunked.extend(bytes(value))
            value = chunked
        super().__setitem__(key, value)


class _FastLock:
    """A trio.Lock whose ``acquire`` takes a free lock without a scheduler round trip.

    trio's ``Lock.acquire`` always checkpoints (yields to the scheduler), even when the lock is
    free; Yamux takes two or three locks per frame. Every section these guard either awaits I/O
    (which checkpoints) or is short and synchronous, so no loop can starve the scheduler.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def acquire(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    def acquire_nowait(self) -> None:
        self._lock.acquire_nowait()

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def statistics(self) -> Any:
        return self._lock.statistics()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


# 15. one writer per connection ----------------------------------------------------------------
#: Data bytes a connection's writer queue holds before stream writes wait for room (control
#: frames are always admitted).
WRITE_QUEUE_BYTES = 4 << 20
#: Seconds a closing connection waits for its queued frames and GO_AWAY to reach the socket.
CLOSE_FLUSH_S = 2.0


def give_each_connection_a_writer() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    from ..conn_writer import ConnectionWriter

    orig_init = ymod.Yamux.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        self._sn_writer = ConnectionWriter(
            self.secured_conn.write, max_queued=WRITE_QUEUE_BYTES, on_failure=self.secured_conn.close,
            name=str(getattr(self, "peer_id", ""))[:16])

    ymod.Yamux.__init__ = __init__


def run_the_writer_beside_the_reader() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    async def start(self: Any) -> None:
        # Upstream's start, with the writer running beside the reader in the connection's
        # nursery: it stops when the reader does (the connection is gone), and not before.
        if self.event_started.is_set():
            return
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self._sn_writer.run)
            nursery.start_soon(self._measure_rtt_loop)
            nursery.start_soon(self._stale_stream_sweeper)
            await nursery.start(self._handle_incoming_with_ready_signal)
            self._established = True
            self.event_started.set()
        try:
            self.new_stream_send_channel.close()
        except trio.ClosedResourceError:
            pass

    ymod.Yamux.start = start


def queue_frames_for_the_writer() -> None:
    from libp2p.io.exceptions import ConnectionClosedError
    from libp2p.network.connection.exceptions import RawConnError
    from libp2p.stream_muxer.yamux import yamux as ymod

    from ..conn_writer import WriterClosed

    class WriterGone(ConnectionClosedError, RawConnError):
        """The connection's writer stopped: both upstream's close/reset paths (which expect
        ConnectionClosedError) and its reader loop (which stops on RawConnError) understand it."""

    urgent_types = (ymod.TYPE_WINDOW_UPDATE, ymod.TYPE_PING)

    async def _write_frame(self: Any, data: bytes) -> None:
        # Control frames (and upstream's unbatched data frames) are queued whole and not waited
        # for on the wire, so a reset or window update is never cut; the queue's control slack
        # bounds them (the reader answering a flood of pings waits here, as upstream's reader
        # waited on its socket write). Window updates and pings without FIN/RST jump the data
        # queue: nothing sent earlier must precede them.
        writer = self._sn_writer
        try:
            await writer.wait_for_room(len(data), control=True)
            typ = data[1] if len(data) > 3 else None
            flags = int.from_bytes(data[2:4], "big") if len(data) > 3 else 0
            urgent = typ in urgent_types and not flags & (ymod.FLAG_FIN | ymod.FLAG_RST)
            frame = writer.push(data, urgent=urgent)
        except WriterClosed as e:
            raise WriterGone(str(e)) from None
        if typ == ymod.TYPE_GO_AWAY and writer.started:
            # The last frame of a closing connection: let it (and all before it) reach the socket.
            with trio.move_on_after(CLOSE_FLUSH_S):
                try:
                    await frame.written()
                except WriterClosed:
                    pass
        await trio.lowlevel.cancel_shielded_checkpoint()

    ymod.Yamux._write_frame = _write_frame


# Whether a stream's reset came after the peer's FIN (the data was whole) is noted when the
# reset is recorded locally or by the connection's end; a remote RST leaves recv_closed as it
# was, so recv_closed itself tells for that one.
def report_resets_after_the_buffered_bytes() -> None:
    from libp2p.stream_muxer.exceptions import MuxedStreamEOF, MuxedStreamReset
    from libp2p.stream_muxer.yamux import yamux as ymod

    orig_read = ymod.YamuxStream.read

    async def read(self: Any, n: int | None = -1) -> bytes:
        # Once a reset stream's buffered bytes are read, upstream forgets the stream and the next
        # read says "end of stream": a message cut short by a reset would pass for a whole one.
        # And upstream calls a stream whose FIN came before the reset "reset", though its data
        # was whole (go-yamux reads such a stream to a clean end).
        try:
            return await orig_read(self, n)
        except (MuxedStreamEOF, MuxedStreamReset) as e:
            whole = self.__dict__.get("_sn_fin_before_reset", self.recv_closed)
            if self.reset_received and not whole:
                raise MuxedStreamReset("Stream was reset") from None
            if isinstance(e, MuxedStreamReset) and whole:
                raise MuxedStreamEOF("Stream is closed for receiving") from None
            raise

    ymod.YamuxStream.read = read


def note_fin_and_wake_readers_on_reset() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    orig_reset = ymod.YamuxStream.reset

    async def reset(self: Any) -> None:
        self.__dict__.setdefault("_sn_fin_before_reset", self.recv_closed)
        # Upstream drops the stream's wake-up event without setting it: a task reading the same
        # stream would sleep on it forever.
        event = self.conn.stream_events.get(self.stream_id)
        try:
            await orig_reset(self)
        finally:
            if event is not None:
                event.set()

    ymod.YamuxStream.reset = reset


def note_fin_when_the_connection_fails() -> None:
    from libp2p.stream_muxer.yamux import yamux as ymod

    orig_cleanup = ymod.Yamux._cleanup_on_error

    async def _cleanup_on_error(self: Any) -> None:
        for stream in list(self.streams.values()):
            stream.__dict__.setdefault("_sn_fin_before_reset", stream.recv_closed)
        await orig_cleanup(self)

    ymod.Yamux._cleanup_on_error = _cleanup_on_error


async def _reset_cut_stream(stream: Any) -> None:
    """Reset a Yamux stream whose write was cut after part of it was queued, even from a
    cancelled task (the reset is queued, never waited for on the wire)."""
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_FLUSH_S):
        try:
            await stream.reset()
        except Exception as e:
            log.debug("reset of a cut stream failed: %s", e)


# 17. streams opened on one connection ---------------------------------------------------------
def refuse_streams_over_the_connection_limit_at_once() -> None:
    from libp2p.stream_muxer.yamux.yamux import Yamux

    from ...errors import StreamLimitError
    from ..identity import short
    from ..limits import Refusals

    open_stream = Yamux.open_stream
    refusals = Refusals(log)

    async def _open_stream(self: Any) -> Any:
        # No checkpoint comes between this check and upstream's acquire_nowait: a free slot seen
        # here is the one upstream takes.
        if self.stream_backlog_semaphore.value == 0:
            held, closed_by_peer = streams_held(self)
            limit = self.stream_backlog_limit
            refusals.note("streams_per_connection", self.peer_id,
                          f"limit of {limit} streams opened per connection (py-libp2p Yamux): refused a new "
                          f"stream to {short(self.peer_id)}; {closed_by_peer} of the {held} held were closed by "
                          f"the peer and never closed here")
            raise StreamLimitError(
                f"cannot open a stream to {short(self.peer_id)}: this node holds {held} streams open on its "
                f"connection to it, the limit of {limit} per connection (py-libp2p Yamux); {closed_by_peer} "
                f"of them were closed by the peer and never closed here (close or reset every stream "
                f"opened, also once the peer has closed its side)")
        return await open_stream(self)

    Yamux.open_stream = _open_stream


def streams_held(muxed: Any) -> tuple[int, int]:
    """(streams this node opened on a Yamux connection that still hold one of its
    ``stream_backlog_limit`` slots, how many of those the peer has closed its side of)."""
    held = [s for s in list(getattr(muxed, "streams", {}).values())
            if getattr(s, "_owns_backlog_slot", False) and not getattr(s, "_backlog_slot_released", True)]
    return len(held), sum(1 for s in held if s.recv_closed)
