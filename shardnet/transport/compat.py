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
6. Data path speed (untuned: ~0.1x raw TCP throughput, ~8x raw round trip). The wire format is
   unchanged (interoperable Noise and Yamux); only how py-libp2p produces and parses it:
   - Noise transport messages are read through a receive buffer (one ``recv`` yields many
     messages) instead of two exact reads per message, and a write of many messages is
     encrypted into one socket write.
   - The secure session's read buffer is a bytearray with an offset, not a BytesIO copied on
     every partial read.
   - A Yamux stream write sends every frame its window allows in one secure-session write, and
     Yamux's per-frame debug formatting (built even when debug logging is off) is skipped.
   - Frames of 256 KiB instead of 64 KiB to peers that advertise LARGE_FRAMES_PROTOCOL (other
     shardnet nodes), since the receiving side's cost is mostly per frame.
   - Stream receive buffers are chunk queues: upstream's ``del bytearray[:n]`` per read made
     reading quadratic in the amount buffered (throughput halved whenever the window grew).
   - Window updates follow go-yamux (credit when half the target window is owed) from a 2 MiB
     initial target, instead of one WINDOW_UPDATE frame per read.
   - Yamux's locks and NetStream's state lock take a free lock without a scheduler round trip.
7. mDNS advertises the raw transport addresses, so a node listening on 0.0.0.0 tells the LAN
   to dial ``/ip4/0.0.0.0/...`` (which only works when both run on one host). It now advertises
   what the host advertises everywhere else (``get_addrs()``: per-interface or announced).
8. Identify's observed address. Once a peer has any relayed connection, py-libp2p reports a
   circuit address as that peer's observed address on *every* connection, and on a relayed one
   it has no IP part (``/p2p/<relay>/p2p-circuit/p2p/<peer>``), which other implementations
   reject and which tells the peer nothing about its NAT. A direct connection now reports its
   socket's remote address and a relayed one reports none (the field is optional).
9. A second connection to a peer (a hole-punched one next to the relayed one) makes the swarm
   trim to ``max_connections_per_peer`` at once, closing whichever has fewer streams, which can
   be the new direct one or a relayed one with a stream in flight. With a direct connection next
   to relayed ones the swarm now trims nothing: the hole puncher retires the relayed
   connection once its last stream ends (new streams already prefer the direct one).
10. Yamux pings each connection every 30 s to measure its round trip and only notes a missing
   answer, so a connection whose path died silently (a NAT forgot the mapping, a relay or a
   router vanished) looks alive until TCP gives up, many minutes later. The ping interval is now
   the node's ``keepalive_interval``, and the node closes a connection whose last ping went
   unanswered for ``keepalive_timeout`` (node.py), which is what starts reconnection.
11. Every peer that sends us a KAD request goes into our routing table, on the assumption that
   it serves the DHT. DHT clients send requests too: a server then hands clients out in lookup
   answers, others query them ("protocol not supported") and dial them back (measured: a
   client's peers opened connections to it, so its round trips went round the emulated WAN
   link it was meant to measure). Per the Kademlia spec a peer joins the table only when its
   identify lists the KAD protocol; a server whose identify had not finished when its first
   request came is added by the node's discovery loop once it has, and a peer that entered the
   table on another path (upstream adds whoever it queries, before knowing) leaves it once
   identify shows it a client (node.py). Lookups neither query nor return peers identified as
   clients (with a small table, upstream starts them from every connected peer).

12. An inbound stream waits on one semaphore shared by every peer (10,000 slots) and is then
   handled, whoever opened it and however many it already has: one peer opening streams in a
   loop takes every slot, and everyone's streams queue behind it. Inbound streams now pass the
   node's stream gate first (limits.py: open streams and new streams per second, per peer); a
   stream over its peer's limit is reset before any protocol is read, and a peer that keeps at
   it is banned for a while (disconnected; new connections closed once the handshake names it).
   The shared semaphore is sized by ``Limits.streams_total`` (host.py). And an exception out of
   any protocol handler (seen: gossipsub lets protobuf's DecodeError out on a garbage RPC) went
   up through the connection into the host and ended the whole node: it now resets that one
   stream and is logged (one line per peer and protocol per 10 s). Tests: tests/test_limits.py,
   tests/test_node.py::test_garbage_on_a_libp2p_protocol_resets_only_that_stream.
13. Unbounded reads from strangers, before any handshake. Multistream-select reads a varint
   length and then that many bytes (no limit), and a TCP read of n bytes asks the socket for n
   at once, which allocates n: four random bytes from anyone who can reach the port made the
   node allocate up to gigabytes (measured: a quarter of a victim's CPU in ``recv`` under a
   raw-garbage flood). Multistream messages are now limited to 64 KiB (go-multistream refuses
   longer ones too), a TCP read takes at most 256 KiB per call, new inbound connections from one
   IP address are rate-limited (``connection_rate_per_ip``), an inbound TCP connection must
   open with the multistream header (20 bytes, checked before anything else runs), and the
   whole inbound upgrade (header, Noise, Yamux) must finish within the node's
   ``handshake_s`` limit.
14. A DHT request stream is read message after message with no limit on how many or how fast.
   Each message read from a stream the node meters (dht.py: inbound request streams) first takes
   a token from its peer's bucket (``dht_requests_per_peer``); without one the stream is reset.
   Test: tests/test_limits.py::test_dht_requests_per_peer.

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
   midway does not reset its stream. Tests: tests/test_cancel_safety.py.

Fixes that are settings or wrappers rather than patches live where they are used, each tested
too: host.py (250 ms happy-eyeballs dial delay, auto-connector dialling ~100 peers, dial
retries, SO_REUSEPORT letting two nodes share a port), pubsub.py (120 s heartbeat, 10 msgs/s
spam limit), dht.py (incomplete and duplicated provider lookups, unroutable long keys),
node.py (60 s negative dial cache, listening sockets left open at shutdown), allocator.py.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

import trio

log = logging.getLogger(__name__)

_applied = False

#: Set to "1" to leave py-libp2p's data path as shipped (fix 6 off), for side-by-side benchmarks.
ENV_UNTUNED_DATA_PATH = "SHARDNET_UNTUNED_DATA_PATH"
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
    _fix_mdns_addresses()
    _fix_observed_address_on_relayed_connections()
    _leave_relayed_connections_to_the_hole_puncher()
    _keep_dht_clients_out_of_routing_tables()
    _gate_inbound_streams()
    _bound_reads_from_strangers()
    _meter_dht_requests()
    _send_through_one_writer()
    if os.environ.get(ENV_UNTUNED_DATA_PATH) != "1":
        _speed_up_noise()
        _speed_up_secure_session()
        _speed_up_yamux_writes()
        _lock_free_net_stream_state()


def dropped_pubsub_messages() -> int:
    """How many gossipsub messages were dropped because a subscriber's queue was full."""
    return _pubsub_drops


# 10. keepalive --------------------------------------------------------------------------------
def set_keepalive_interval(seconds: float) -> None:
    """Seconds between Yamux pings on every connection of this process."""
    from libp2p.stream_muxer.yamux import yamux

    yamux.RTT_MEASURE_INTERVAL = seconds


def unanswered_ping_age(muxed: Any) -> float | None:
    """Seconds since the connection's last ping was sent if no answer came yet (None: answered,
    none sent yet, or not a Yamux connection)."""
    event, sent = getattr(muxed, "_ping_event", None), getattr(muxed, "_ping_sent_time", 0.0)
    if event is None or not sent or event.is_set():
        return None
    return trio.current_time() - sent


# 8. identify's observed address -------------------------------------------------------------
def _fix_observed_address_on_relayed_connections() -> None:
    from libp2p.identity.identify import identify

    # handle_identify passes the stream's socket address as ``fallback``; relayed streams have
    # none (their raw connection is a relay stream), so they now report no observed address.
    identify._prefer_circuit_addr = lambda host, peer_id, fallback: fallback


# 9. trimming a direct connection next to relayed ones -----------------------------------------
def _leave_relayed_connections_to_the_hole_puncher() -> None:
    from libp2p.network.swarm import Swarm

    from .nat.relay import is_relayed

    trim = Swarm._trim_connections

    def _trim_connections(self, peer_id) -> None:
        conns = self.connections.get(peer_id, [])
        kinds = {is_relayed(c) for c in conns}
        if kinds == {True, False}:
            return
        trim(self, peer_id)

    Swarm._trim_connections = _trim_connections


# 11. DHT clients in routing tables -------------------------------------------------------------
def serves_dht(peerstore: Any, peer_id: Any) -> bool | None:
    """Whether the peer's identify lists the KAD protocol; None before identify has run."""
    from libp2p.kad_dht.common import PROTOCOL_ID

    try:
        protocols = peerstore.get_protocols(peer_id)
    except Exception:  # PeerStoreError: not in the peerstore (yet, or any more)
        return None
    return str(PROTOCOL_ID) in protocols if protocols else None


def _keep_dht_clients_out_of_routing_tables() -> None:
    from libp2p.kad_dht.kad_dht import KadDHT
    from libp2p.kad_dht.peer_routing import PeerRouting

    add_peer = KadDHT.add_peer

    async def add_peer_if_server(self, peer_id, *, skip_server_mode_check: bool = False) -> bool:
        # upstream skips the check exactly where it matters: for whoever sent us a request
        if skip_server_mode_check and not serves_dht(self.host.get_peerstore(), peer_id):
            return False
        return await add_peer(self, peer_id, skip_server_mode_check=skip_server_mode_check)

    KadDHT.add_peer = add_peer_if_server

    # With under 5 peers in its table a lookup also starts from every connected peer and every
    # peer in the peerstore, clients included, and its result (where records and provider
    # entries are stored) can end up naming them.
    query = PeerRouting._query_single_peer_for_closest
    lookup = PeerRouting.find_closest_peers_network

    async def query_if_server(self, peer, target_key, new_peers) -> None:
        if serves_dht(self.host.get_peerstore(), peer) is not False:
            await query(self, peer, target_key, new_peers)

    async def lookup_servers(self, target_key: bytes, count: int = 20) -> list:
        store = self.host.get_peerstore()
        return [p for p in await lookup(self, target_key, count) if serves_dht(store, p) is not False]

    PeerRouting._query_single_peer_for_closest = query_if_server
    PeerRouting.find_closest_peers_network = lookup_servers


# 5. logging ---------------------------------------------------------------------------------
# 12. inbound streams per peer ---------------------------------------------------------------------
def _gate_inbound_streams() -> None:
    from libp2p.network.connection.swarm_connection import SwarmConn

    from .limits import Refusals

    handle = SwarmConn._handle_muxed_stream
    failures = Refusals()

    async def _handle_muxed_stream(self: Any, muxed_stream: Any) -> None:
        gate = getattr(self.swarm, "stream_gate", None)
        peer = self.muxed_conn.peer_id
        if gate is not None and not gate.admit(peer):
            await _reset_quietly(muxed_stream)
            if gate.is_banned(peer):
                await _close_peer(self.swarm, peer)
            return
        try:
            await handle(self, muxed_stream)
        except Exception as e:  # a handler's failure is its stream's, never the node's
            protocol = getattr(muxed_stream, "protocol", None) or "?"
            failures.note(f"handler {protocol}", peer, f"a {protocol} handler failed on a stream from {str(peer)[:16]} "
                                                       f"({type(e).__name__}: {str(e)[:200]}); stream reset")
            await _reset_quietly(muxed_stream)
        finally:
            if gate is not None:
                gate.release(peer)

    SwarmConn._handle_muxed_stream = _handle_muxed_stream


async def _close_peer(swarm: Any, peer: Any) -> None:
    try:
        await swarm.close_peer(peer)
    except Exception as e:
        log.debug("closing banned peer %s: %s", peer, e)


async def _reset_quietly(stream: Any) -> None:
    try:
        await stream.reset()
    except Exception:
        pass


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

    from .nat.rawstream import PrefixedStream
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.network.swarm import Swarm

    async def _do_handle_inbound_connection(
        self: Any, read_write_closer: Any, maddr: Any, failure_event: Any
    ) -> None:
        gate = getattr(self, "connection_rate", None)
        tcp = not isinstance(read_write_closer, IMuxedConn)
        if gate is not None and tcp and not gate.admit(_remote_ip(read_write_closer)):
            _drop(read_write_closer)  # fix 13: before anything else is built
            return
        remote_maddr = self._build_remote_multiaddr(read_write_closer)
        if remote_maddr is not None and not await self.connection_gate.is_allowed(remote_maddr):
            log.debug("inbound connection from %s refused by the connection gate", remote_maddr)
            await _close_quietly(read_write_closer)
            return
        raw_conn = None
        deadline = getattr(self, "handshake_timeout", None) or float("inf")
        try:
            if isinstance(read_write_closer, IMuxedConn):
                muxed = read_write_closer
                await self.add_conn(muxed, direction="inbound")
            else:
                with trio.fail_after(deadline):  # fix 13: the whole upgrade, stranger's pace
                    opening = await _opening_bytes(read_write_closer)
                    raw_conn = RawConnection(PrefixedStream(read_write_closer, opening), False)
                    muxed = await self.upgrade_inbound_raw_conn(raw_conn, maddr)
        except Exception as e:  # an inbound handshake failing must not hurt the listener
            log.debug("inbound connection on %s failed: %r", maddr, e)
            await _close_quietly(raw_conn if raw_conn is not None else read_write_closer)
            return
        streams = getattr(self, "stream_gate", None)
        if streams is not None and streams.is_banned(muxed.peer_id):
            await _close_peer(self, muxed.peer_id)  # fix 12: a banned peer, now that we know who
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


# 13. bounded reads before the handshake ------------------------------------------------------------
MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"
MAX_MULTISTREAM_MESSAGE = 64 << 10
MAX_TCP_READ = 256 << 10


def _drop(stream: Any) -> None:
    """Close a TCP connection at once (a refused flood of them should cost next to nothing)."""
    try:
        stream.stream.socket.close()
    except Exception:
        pass


def _remote_ip(stream: Any) -> str:
    try:
        return str(stream.get_remote_address()[0])
    except Exception:
        return "unknown"


class NotMultistream(Exception):
    """An inbound connection that did not open with the multistream-select header."""


async def _opening_bytes(stream: Any) -> bytes:
    got = b""
    while len(got) < len(MULTISTREAM_HEADER):
        chunk = await stream.read(len(MULTISTREAM_HEADER) - len(got))
        if not chunk:
            raise NotMultistream(f"closed after {len(got)} bytes")
        got += chunk
        if not MULTISTREAM_HEADER.startswith(got):
            raise NotMultistream(f"opened with {got[:20]!r}")
    return got


def _bound_reads_from_strangers() -> None:
    import libp2p.protocol_muxer.multiselect_communicator as communicator
    import libp2p.utils as utils
    import libp2p.utils.varint as varint
    from libp2p.exceptions import ParseError
    from libp2p.io.trio import TrioTCPStream

    async def read_delim(reader: Any) -> bytes:
        msg = await varint.read_varint_prefixed_bytes_limited(reader, MAX_MULTISTREAM_MESSAGE)
        if not msg or msg[-1:] != b"\n":
            raise ParseError("multistream message is not newline-delimited")
        return msg[:-1]

    for module in (varint, utils, communicator):
        module.read_delim = read_delim

    read = TrioTCPStream.read

    async def bounded_read(self: Any, n: int | None = None) -> bytes:
        return await read(self, MAX_TCP_READ if n is None or n > MAX_TCP_READ else n)

    TrioTCPStream.read = bounded_read


# 14. DHT requests per peer ------------------------------------------------------------------------
class RequestRateExceeded(Exception):
    """A peer sent DHT requests faster than its limit."""


def _meter_dht_requests() -> None:
    import libp2p.kad_dht.kad_dht as kad_dht

    read = kad_dht.read_varint_prefixed_bytes_limited

    async def metered_read(stream: Any, max_length: int) -> bytes:
        meter = getattr(stream, "kad_request_meter", None)
        if meter is not None:
            bucket, peer, refusals = meter
            if not bucket.take(peer):
                refusals.note("dht_requests_per_peer", peer, f"limit dht_requests_per_peer: {str(peer)[:16]} "
                                                             f"sends DHT requests faster than {bucket.rate:g}/s")
                raise RequestRateExceeded(str(peer))
        return await read(stream, max_length)

    kad_dht.read_varint_prefixed_bytes_limited = metered_read


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


# 7. mDNS addresses ----------------------------------------------------------------------------
def _fix_mdns_addresses() -> None:
    from libp2p.discovery.mdns import broadcaster

    def _resolve_host_addrs(self: Any) -> list[str]:
        if self.host is None:
            return self.listen_addrs or []
        return [str(a).rsplit("/p2p/", 1)[0] for a in self.host.get_addrs()]

    broadcaster.PeerBroadcaster._resolve_host_addrs = _resolve_host_addrs


# 6. data path ---------------------------------------------------------------------------------
#: Bytes asked of the socket per receive on the Noise transport.
NOISE_RECV_CHUNK = 1 << 18


def _speed_up_noise() -> None:
    from cryptography.exceptions import InvalidTag
    from libp2p.io.exceptions import IncompleteReadError
    from libp2p.security.noise import io as nio
    from noise.exceptions import NoiseInvalidMessage

    cls = nio.NoiseTransportReadWriter
    max_plain = nio.MAX_PLAINTEXT_LENGTH

    # The cipher states are driven directly: NoiseConnection.encrypt/decrypt insist on ``bytes``,
    # which would cost one more copy of every message in each direction.
    async def read_msg(self: Any, prefix_encoded: bool = False) -> bytes:
        # Receive buffer with a read offset: parsing a message moves nothing; the consumed
        # prefix is dropped only when more bytes must be appended.
        d = self.__dict__
        buf = d.get("_sn_rbuf")
        if buf is None:
            buf = d["_sn_rbuf"] = bytearray()
            d["_sn_rpos"] = 0
        raw = self.read_writer.read_write_closer
        while True:
            pos = d["_sn_rpos"]
            avail = len(buf) - pos
            if avail >= 2:
                n = (buf[pos] << 8) | buf[pos + 1]
                if avail >= 2 + n:
                    start = pos + 2 + (len(self.prefix) if prefix_encoded else 0)
                    d["_sn_rpos"] = pos + 2 + n
                    with memoryview(buf) as view:
                        try:
                            return self.noise_state.noise_protocol.cipher_state_decrypt.decrypt_with_ad(
                                None, view[start : pos + 2 + n]
                            )
                        except InvalidTag:
                            raise NoiseInvalidMessage("Failed authentication of message") from None
            if pos:
                del buf[:pos]
                d["_sn_rpos"] = 0
            chunk = await raw.read(NOISE_RECV_CHUNK)
            if not chunk:
                raise IncompleteReadError(
                    f"connection closed with {len(buf)} bytes of a Noise message buffered",
                    expected_bytes=2,
                    received_bytes=len(buf),
                )
            buf += chunk

    async def write_msg(self: Any, msg: bytes, prefix_encoded: bool = False) -> None:
        seal = self.noise_state.noise_protocol.cipher_state_encrypt.encrypt_with_ad
        parts: list[bytes] = []
        with memoryview(msg) as view:
            for start in range(0, max(len(view), 1), max_plain):
                sealed = seal(None, view[start : start + max_plain])
                if prefix_encoded and start == 0:
                    sealed = self.prefix + sealed
                parts.append(len(sealed).to_bytes(2, "big"))
                parts.append(sealed)
        await self.read_writer.read_write_closer.write(b"".join(parts))

    cls.read_msg = read_msg
    cls.write_msg = write_msg


def _speed_up_secure_session() -> None:
    from libp2p.io.exceptions import ConnectionClosedError
    from libp2p.security.secure_session import SecureSession

    def _reset_internal_buffer(self: Any) -> None:
        self.__dict__["_sn_buf"] = bytearray()

    async def read(self: Any, n: int | None = None) -> bytes:
        if n == 0:
            return b""
        buf = self.__dict__["_sn_buf"]
        if not buf:
            msg = await self.conn.read_msg()
            if msg == b"":
                raise ConnectionClosedError("Connection closed")
            if n is None or len(msg) <= n:
                return msg
            buf += msg
        if n is None or n >= len(buf):
            out = bytes(buf)
            buf.clear()
            return out
        out = bytes(buf[:n])
        del buf[:n]
        return out

    SecureSession._reset_internal_buffer = _reset_internal_buffer
    SecureSession.read = read


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


def _speed_up_yamux_writes() -> None:
    from libp2p.stream_muxer.exceptions import MuxedStreamEOF, MuxedStreamError, MuxedStreamReset
    from libp2p.stream_muxer.yamux import yamux as ymod

    from .conn_writer import WriterClosed

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

    orig_init = ymod.YamuxStream.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        # Start from a larger target than the spec's 256 KiB initial window (granted to the
        # sender by the first window update); auto-tuning still grows it toward 16 MiB on long
        # paths. 256 KiB in flight caps a loopback stream at the speed of one update round trip.
        self.target_recv_window = YAMUX_INITIAL_TARGET_WINDOW
        self.window_lock = _FastLock()

    ymod.YamuxStream.__init__ = __init__

    orig_conn_init = ymod.Yamux.__init__

    def conn_init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_conn_init(self, *args, **kwargs)
        self.streams_lock = _FastLock()
        self.stream_buffers = _ChunkBufferDict(self.stream_buffers)

    ymod.Yamux.__init__ = conn_init

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

    orig_read_body = ymod.Yamux._read_data_body
    from libp2p.io.exceptions import IncompleteReadError

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


def _lock_free_net_stream_state() -> None:
    """NetStream takes a trio.Lock around a synchronous state check on every read and write: a
    scheduler round trip each time, guarding sections that never await (except a final,
    idempotent ``remove()``), which single-threaded trio already makes atomic."""
    from libp2p.network.stream import net_stream as nmod

    orig_init = nmod.NetStream.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        self._state_lock = _NoCheckpointLock()

    nmod.NetStream.__init__ = __init__


class _NoCheckpointLock:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


# 15. one writer per connection ----------------------------------------------------------------
#: Data bytes a connection's writer queue holds before stream writes wait for room (control
#: frames are always admitted).
WRITE_QUEUE_BYTES = 4 << 20
#: Seconds a closing connection waits for its queued frames and GO_AWAY to reach the socket.
CLOSE_FLUSH_S = 2.0


def _send_through_one_writer() -> None:
    from libp2p.io.exceptions import ConnectionClosedError
    from libp2p.network.connection.exceptions import RawConnError
    from libp2p.stream_muxer.yamux import yamux as ymod

    from .conn_writer import ConnectionWriter, WriterClosed

    orig_init = ymod.Yamux.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        self._sn_writer = ConnectionWriter(
            self.secured_conn.write, max_queued=WRITE_QUEUE_BYTES, on_failure=self.secured_conn.close,
            name=str(getattr(self, "peer_id", ""))[:16])

    ymod.Yamux.__init__ = __init__

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

    from libp2p.stream_muxer.exceptions import MuxedStreamEOF, MuxedStreamReset

    # Whether a stream's reset came after the peer's FIN (the data was whole) is noted when the
    # reset is recorded locally or by the connection's end; a remote RST leaves recv_closed as it
    # was, so recv_closed itself tells for that one.
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
