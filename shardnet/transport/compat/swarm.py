"""Patches to py-libp2p's swarm (``libp2p.network``): connections, inbound streams, NetStream.

1. Inbound connections held forever. ``Swarm._do_handle_inbound_connection`` waits for the
   *swarm* to finish instead of the connection, so every inbound connection ever accepted keeps
   a task and an inbound-limit slot: after ~250 connections a node refuses everything.
   Fixed by waiting for that connection's own close event (and, fix 13, by checking a stranger's
   connection rate, opening bytes and handshake deadline before anything else runs).
3. Fixed ``trio.sleep(0.1)`` calls on the disconnect path (~200 ms per disconnect). They exist
   to force a context switch, which a zero-length sleep also does (here for swarm_connection;
   yamux.py installs the same proxy, naps.py's, in Yamux's module).
6. (data path) NetStream takes a trio.Lock around a synchronous state check on every read and
   write: a scheduler round trip each time, guarding sections that never await.
9. A second connection to a peer (a hole-punched one next to the relayed one) makes the swarm
   trim to ``max_connections_per_peer`` at once, closing whichever has fewer streams, which can
   be the new direct one or a relayed one with a stream in flight. With a direct connection next
   to relayed ones the swarm now trims nothing: the hole puncher retires the relayed
   connection once its last stream ends (new streams already prefer the direct one).
12. An inbound stream waits on one semaphore shared by every peer (10,000 slots) and is then
   handled, whoever opened it and however many it already has: one peer opening streams in a
   loop takes every slot, and everyone's streams queue behind it. Inbound streams now pass the
   node's stream gate first (limits.py: open streams and new streams per second, per peer); a
   stream over its peer's limit is reset before any protocol is read, and a peer that keeps at
   it is banned for a while (disconnected; new connections closed once the handshake names it).
   The shared semaphore is sized by ``Limits.streams_total`` (host.py). And an exception out of
   any protocol handler (seen: gossipsub lets protobuf's DecodeError out on a garbage RPC) went
   up through the connection into the host and ended the whole node: it now resets that one
   stream and is logged (one line per peer and protocol per 10 s).
17. Every stream, both directions, takes one of the swarm's ``Limits.streams_total`` slots (the
   semaphore of fix 12) until it ends, and a new stream waited silently for a free one. Now a
   stream this node opens fails at once with StreamLimitError naming the limit, logged here;
   inbound streams still wait (yamux.py has the per-connection half of this fix).

The accessors at the end are the only places shardnet reads the swarm's private state.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from ..config import dial_place
from .naps import TrioWithoutCleanupNaps
from .tcp import _drop, _opening_bytes, _remote_ip

log = logging.getLogger(__name__)


# 1. inbound connection lifetime ---------------------------------------------------------------
def wait_for_each_inbound_connection_only() -> None:
    from libp2p.abc import IMuxedConn
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.network.swarm import Swarm

    from ..nat.rawstream import PrefixedStream

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


# 3. disconnect sleeps -------------------------------------------------------------------------
def skip_swarm_connection_naps() -> None:
    from libp2p.network.connection import swarm_connection

    swarm_connection.trio = TrioWithoutCleanupNaps()


# 9. trimming a direct connection next to relayed ones -----------------------------------------
def leave_relayed_connections_to_the_hole_puncher() -> None:
    from libp2p.network.swarm import Swarm

    trim = Swarm._trim_connections

    def _trim_connections(self, peer_id) -> None:
        conns = self.connections.get(peer_id, [])
        kinds = {is_relayed(c) for c in conns}
        if kinds == {True, False}:
            return
        trim(self, peer_id)

    Swarm._trim_connections = _trim_connections


# 12. inbound streams per peer -----------------------------------------------------------------
def gate_inbound_streams() -> None:
    from libp2p.network.connection.swarm_connection import SwarmConn

    from ..limits import Refusals

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


# 17. streams open in all ---------------------------------------------------------------------
def refuse_streams_over_the_total_at_once() -> None:
    from libp2p.network.swarm import Swarm

    from ...errors import StreamLimitError
    from ..identity import short
    from ..limits import Refusals
    from .yamux import streams_held

    new_stream = Swarm.new_stream
    refusals = Refusals(log)

    async def _new_stream(self: Any, peer_id: Any) -> Any:
        slots = self._stream_semaphore
        # new_stream's first await is the acquire: a free slot seen here is the one it takes
        if slots is not None and slots.value == 0:
            limit = self._resource_manager.limits.max_streams  # the semaphore's size (host.py)
            held = [streams_held(c.muxed_conn) for conns in list(self.connections.values()) for c in conns]
            closed_by_peer = sum(c for _, c in held)
            refusals.note("streams_total", "*", f"limit streams_total ({limit}): refused a new stream to "
                                                f"{short(peer_id)}; {closed_by_peer} streams this node opened "
                                                f"were closed by their peer and never closed here")
            raise StreamLimitError(
                f"cannot open a stream to {short(peer_id)}: this node has {limit} streams open to all peers, "
                f"both directions, its limit streams_total; {closed_by_peer} of those it opened were closed "
                f"by their peer and never closed here (close or reset every stream opened, or raise "
                f"--limit streams_total)")
        return await new_stream(self, peer_id)

    Swarm.new_stream = _new_stream


# 6. data path: NetStream's state lock ---------------------------------------------------------
def lock_free_net_stream_state() -> None:
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


# accessors: the swarm's private state, read only here -----------------------------------------
def forget_failed_dial(swarm: Any, peer_id: Any) -> None:
    """Drop the peer from the swarm's negative dial cache (py-libp2p blocks every dial to a peer
    for 60 s after one failure)."""
    swarm._negative_peer_cache.evict(str(peer_id))


def addrs_first(peerstore: Any, peer_id: Any, addrs: list, ttl: int | None) -> None:
    """Put ``addrs`` ahead of the other addresses held for ``peer_id``, in place (the swarm
    dials the first held address of each transport). ``ttl``: the peer's addresses' new TTL
    (None: kept). Upstream's clear_addrs would also drop the peer's signed record, after which
    an older one from any DHT answer replaces every address again, and raises on expired data."""
    data = peerstore.peer_data_map.get(peer_id)
    if data is None:
        peerstore.add_addrs(peer_id, addrs, 120 if ttl is None else ttl)
        return
    data.addrs[:] = [*addrs, *(a for a in data.addrs if a not in addrs)]
    if ttl is not None:
        data.set_ttl(ttl)
    data.update_last_identified()


def dial_places(peerstore: Any, peer_id: Any) -> list[str]:
    """The distinct direct places held for ``peer_id``, in the order the swarm would take them
    (loopback ones only when no other is held, as ``Swarm.dial_peer`` picks)."""
    data = peerstore.peer_data_map.get(peer_id)
    direct = [dial_place(a) for a in (data.addrs if data is not None else ()) if "/p2p-circuit" not in str(a)]
    public = [a for a in direct if "/ip4/127." not in a and "/ip6/::1" not in a]
    return list(dict.fromkeys(public or direct))


def dialled_addr_to_back(peerstore: Any, peer_id: Any) -> None:
    """Move the place the swarm dialled for ``peer_id`` (``dial_places``' first; every spelling
    of it) to the back of its addresses: after that dial failed, the next one is dialled."""
    places = dial_places(peerstore, peer_id)
    if len(places) > 1:
        data = peerstore.peer_data_map[peer_id]
        data.addrs.sort(key=lambda a: dial_place(a) == places[0])  # (stable: the rest keep their order)


def connection_type(conn: Any) -> Any:
    """The ``ConnectionType`` a raw or swarm connection records for itself; None on any other
    layer (muxed, secured), whose type is its raw connection's."""
    return getattr(conn, "_connection_type", None)


def is_relayed(conn: Any) -> bool:
    """Whether a connection (swarm, muxed or raw) runs through a relay: follows the layers down
    to the raw connection, which knows its type."""
    from libp2p.abc import ConnectionType

    seen = 0
    while conn is not None and seen < 8:
        kind = connection_type(conn)
        if kind is not None:
            return kind == ConnectionType.RELAYED
        conn = next((getattr(conn, a) for a in ("muxed_conn", "secured_conn", "conn", "read_writer", "raw_conn")
                     if getattr(conn, a, None) is not None), None)
        seen += 1
    return False
