"""The connection manager: a core node behaviour that keeps a node's connections between its
watermarks, so that its fan-out (and the keepalive pings, gossip and identify traffic each
connection carries) stays bounded however large the swarm is.

Connections come from many places: discovery tops up to ``low_watermark``, DHT walks and claim
lookups dial the peers they ask, clients probe the peers they route through. When a node holds
more than ``high_watermark``, the manager closes idle ones down to ``low_watermark``: never a
protected peer (bootstrap peers, relays we hold a slot at, and whatever is tagged with
``protect(peer, tag)``: a compute peer's chain neighbours), never one carrying a stream (an
activation session, a transfer; gossip's lasting streams aside), never one younger than
``connection_grace_s``; the least recently busy go first. (libp2p's connection
managers in Go and Rust work the same way; py-libp2p 0.8.1 has the watermarks in its config but
prunes nothing.)"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID

from . import compat, identity
from .behaviour import Behaviour
from .config import NodeConfig

log = logging.getLogger(__name__)

#: seconds between two looks at the connections
CHECK_S = 5.0


@dataclass(frozen=True)
class ConnectionsStatus:
    connections: int  # open now
    low_watermark: int
    high_watermark: int
    protected: int  # peers protected now (by any tag)
    trimmed: int  # connections closed so far for being over the high watermark


class ConnectionManager(Behaviour):
    """Close idle, unprotected connections down to ``low_watermark`` whenever more than
    ``high_watermark`` are open (looked at every ``CHECK_S``, and at once after ``trim_soon``).
    Ready at once."""

    def __init__(self, config: NodeConfig) -> None:
        self.low, self.high = config.low_watermark, config.high_watermark
        self.grace = config.connection_grace_s
        self._tags: dict[ID, set[str]] = {}
        #: per peer, when we last saw its connection carry a stream (trio time; or first saw it)
        self._busy_at: dict[ID, float] = {}
        self.trimmed = 0
        self._wake = trio.Event()

    def snapshot(self) -> ConnectionsStatus:
        n = len(self.node.host.get_network().get_connections()) if self.node is not None else 0
        return ConnectionsStatus(n, self.low, self.high, len(self._tags), self.trimmed)

    def protect(self, peer: ID | str, tag: str) -> None:
        """Never close ``peer``'s connection for being over the watermark while it holds ``tag``."""
        self._tags.setdefault(_as_id(peer), set()).add(tag)

    def unprotect(self, peer: ID | str, tag: str) -> None:
        pid = _as_id(peer)
        tags = self._tags.get(pid)
        if tags is not None:
            tags.discard(tag)
            if not tags:
                del self._tags[pid]

    def protected(self, peer: ID | str) -> bool:
        """Tagged, a bootstrap peer, or a relay we hold a slot at."""
        pid = _as_id(peer)
        if self._tags.get(pid):
            return True
        node = self.node
        if any(info.peer_id == pid for info in node.bootstrap.peers):
            return True
        relay_client = node.relay_client
        return relay_client is not None and pid in relay_client.reservations

    def trim_soon(self) -> None:
        self._wake.set()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            with trio.move_on_after(CHECK_S):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self.trim()
            except Exception as e:  # never take the node down over housekeeping
                log.warning("connection trim failed: %s: %s", type(e).__name__, e)

    async def trim(self) -> int:
        """Close connections as the rules say; how many were closed."""
        now = trio.current_time()
        conns = list(self.node.host.get_network().get_connections())
        open_peers = set()
        for conn in conns:
            pid = conn.muxed_conn.peer_id
            open_peers.add(pid)
            if pid not in self._busy_at or _streams(conn):
                self._busy_at[pid] = now
        for pid in [p for p in self._busy_at if p not in open_peers]:
            del self._busy_at[pid]
        excess = len(conns) - self.low
        if len(conns) <= self.high:
            return 0
        idle = [c for c in conns if not self.protected(c.muxed_conn.peer_id) and not _streams(c)
                and now - self._busy_at[c.muxed_conn.peer_id] >= self.grace]
        idle.sort(key=lambda c: self._busy_at[c.muxed_conn.peer_id])
        closed = 0
        for conn in idle[:excess]:
            pid = conn.muxed_conn.peer_id
            with trio.move_on_after(5):
                try:
                    await conn.close()
                    closed += 1
                except Exception as e:
                    log.debug("closing the connection to %s: %s", identity.short(pid), e)
        if closed:
            self.trimmed += closed
            log.info("closed %d idle connections (%d open, high watermark %d)", closed, len(conns), self.high)
        return closed


#: protocols whose streams stay open for a connection's life (gossip links): they do not make it busy
LASTING = compat.yamux.GOSSIP_PROTOCOLS


def _streams(conn) -> int:
    """Streams the connection carries now besides the lasting gossip ones."""
    try:
        return sum(not str(s.get_protocol() or "").startswith(LASTING) for s in conn.get_streams())
    except Exception:
        return 0


def _as_id(peer: ID | str) -> ID:
    return peer if isinstance(peer, ID) else ID.from_base58(peer)
