"""Peer discovery: a node behaviour that walks the DHT for peers, remembers them and keeps
direct connections to them up to the low watermark (mDNS, when enabled, runs inside py-libp2p's
host and its peers reach us as connections, which this behaviour then notes)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from . import compat, identity
from .behaviour import Behaviour, random_phase
from .config import NodeConfig
from .errors import ShardnetError

log = logging.getLogger(__name__)

#: How many discovered peers a node remembers (the oldest are forgotten first).
MAX_DISCOVERED = 10_000


@dataclass(frozen=True)
class DiscoveryStatus:
    discovered: int  # peers remembered (at most MAX_DISCOVERED)
    walks: int  # DHT walks done
    last_walk_at: float | None  # Unix time of the last one
    last_walk_found: int  # peers it returned (known ones included)
    top_up_dials: int  # discovered peers dialled to reach the low watermark


#: the least seconds between two top-ups of the connections outside a walk (below the low
#: watermark): the ceiling of walks before 2026-12-07, when every walk topped up
TOP_UP_GAP_S = 300.0
#: the most seconds such a top-up takes from the loop that notes peers each second
TOP_UP_BUDGET_S = 10.0
#: seconds before a peer whose top-up dial failed is dialled again by a top-up
TOP_UP_RETRY_S = 3600.0


class Discovery(Behaviour):
    """Walk the DHT for peers near ourselves and near random keys, remember them (``discovered``,
    oldest first) and dial them up to ``low_watermark`` connections; between walks, note within a
    second the peers that reached us. Ready at once.

    Walks follow Kademlia's refresh rather than a fixed beat: every ``discovery_interval`` while
    walks find peers we did not know (or connect us to ones we knew: the top-up), then, after
    the first walk that found nothing new, a random share of ``discovery_max_interval`` (an
    hour), then every ``discovery_max_interval`` (a walk queries up to 20 peers, so a fixed 5 s
    beat cost every node a share of a core that grew with the swarm: docs/performance.md); at
    once, and back to the short beat, when ``kick``-ed. Peers that join later reach us (their
    own walks, their DHT queries) and are noted within a second."""

    def __init__(self, config: NodeConfig, on_discovered: Callable[[ID], None] | None = None) -> None:
        self.config = config
        self.on_discovered = on_discovered  # told of each peer once, when first noted
        #: Peers met through discovery, oldest first, at most MAX_DISCOVERED (value: when).
        self.discovered: dict[ID, float] = {}
        self._kicked = trio.Event()
        self._offered_to_table: set[ID] = set()  # peers offered to the DHT routing table
        self.walks = 0
        self.last_walk_at: float | None = None
        self.last_walk_found = 0
        self.top_up_dials = 0
        #: seconds until the next walk (``discovery_interval`` while walks find news, then up to
        #: ``discovery_max_interval``: ``_next_interval``)
        self.interval = config.discovery_interval
        self._settled = False  # a walk found nothing new since the last news
        self._last_top_up = -TOP_UP_GAP_S  # trio time
        #: discovered peers whose last top-up dial failed: when (trio time); not dialled again
        #: for TOP_UP_RETRY_S (a gone peer's addresses stay known for hours)
        self._dial_failed: dict[ID, float] = {}

    def snapshot(self) -> DiscoveryStatus:
        return DiscoveryStatus(len(self.discovered), self.walks, self.last_walk_at, self.last_walk_found,
                               self.top_up_dials)

    def kick(self) -> None:
        """Walk the DHT now rather than at the next interval (a bootstrap peer came back)."""
        self._kicked.set()

    def note(self, peer_id: ID) -> None:
        """Remember ``peer_id`` (once) and tell the node's peer-event watchers."""
        node = self.node
        if peer_id == node.peer_id or peer_id in self.discovered:
            return
        if len(self.discovered) >= MAX_DISCOVERED:  # long-lived nodes see endless churn
            self.discovered.pop(next(iter(self.discovered)))
        self.discovered[peer_id] = time.time()
        log.info("discovered peer %s", peer_id)
        if self.on_discovered is not None:
            self.on_discovered(peer_id)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        node = self.node
        self.interval = self.config.discovery_interval
        while True:
            found: list[ID] = []
            known, dials = len(self.discovered), self.top_up_dials
            with trio.move_on_after(self.config.dht_timeout):
                try:
                    found = await node.dht.closest_peers(node.peer_id.to_bytes())
                    found += await node.dht.closest_peers(_random_peer_id().to_bytes())
                except Exception as e:  # discovery is best effort; the next round retries
                    log.debug("discovery round failed: %s", e)
            self.walks += 1
            self.last_walk_at, self.last_walk_found = time.time(), len(found)
            for pid in found:
                self.note(pid)
                self._dial_failed.pop(pid, None)  # (it answered the walk)
            try:
                await self._top_up_connections()
            except Exception as e:  # a discovery hiccup must never take the node down
                log.warning("connection top-up failed: %s: %s", type(e).__name__, e)
            # new peers, new connections to old ones, or a kick: keep looking at the short beat
            news = len(self.discovered) > known or self.top_up_dials > dials or self._kicked.is_set()
            self.interval = self._next_interval(news)
            self._kicked = trio.Event()
            # Between network walks, pick up peers that reached us (inbound connections, DHT
            # queries) within a second rather than at the next walk.
            # Only when the connections or the table changed since the last look (or a peer's
            # identify was still out): going over every peer each second grew with the swarm.
            last, pending = None, True
            with trio.move_on_after(self.interval):
                while not self._kicked.is_set():
                    connected = frozenset(node.host.get_connected_peers())
                    in_table = frozenset(node.dht.routing_table_peers())
                    now = (connected, in_table)
                    if pending or now != last:
                        for pid in connected | in_table:
                            self.note(pid)
                        pending = await self._tidy_routing_table(connected, in_table)
                        last = now
                    # below the low watermark, dial discovered peers now and then, not only
                    # after a walk (walks are an hour apart once the swarm is known)
                    if len(connected) < self.config.low_watermark and \
                            trio.current_time() - self._last_top_up >= TOP_UP_GAP_S:
                        try:
                            with trio.move_on_after(TOP_UP_BUDGET_S):  # (dials of gone peers time out)
                                await self._top_up_connections()
                        except Exception as e:  # as after a walk: never takes the node down
                            log.warning("connection top-up failed: %s: %s", type(e).__name__, e)
                    with trio.move_on_after(1.0):
                        await self._kicked.wait()

    def _next_interval(self, news: bool) -> float:
        """Seconds to the next walk: the short beat after news; after the first walk that found
        nothing new, a random 5-100 % of the ceiling (nodes started together do not walk
        together ever after, and a window shorter than the ceiling sees each node's walks at
        their long-run rate); then the ceiling. (Doubling from the short beat put every node's
        walks at the same times for the first hour, and a node an hour old walks no more often
        than Kademlia's hourly refresh.)"""
        ceiling = self.config.discovery_max_interval
        if news:
            self._settled = False
            return self.config.discovery_interval
        if not self._settled:
            self._settled = True
            return random_phase(ceiling)
        return ceiling

    async def _tidy_routing_table(self, connected: frozenset[ID], in_table: frozenset[ID]) -> bool:
        """Per identify: peers serving the DHT in the routing table, DHT clients out of it.
        True when some connected peer's identify has not come yet (look again).

        A server is offered once per connection (a full bucket may refuse it; asking again
        each second would ping that bucket's oldest peer each time)."""
        self._offered_to_table &= connected
        dht, store = self.node.dht, self.node.host.get_peerstore()
        pending = False
        for pid in connected:
            serves = compat.serves_dht(store, pid)
            pending = pending or serves is None
            if serves is False and pid in in_table:
                dht.remove_peer(pid)
            elif serves and pid not in in_table and pid not in self._offered_to_table:
                self._offered_to_table.add(pid)
                await dht.add_peer(pid)
        return pending

    async def _top_up_connections(self) -> None:
        """Keep direct connections to discovered peers up to the low watermark, so that
        gossip meshes and streams do not depend on any one node (the bootstrap in particular)."""
        node = self.node
        self._last_top_up = now = trio.current_time()
        connected = set(node.host.get_connected_peers())
        want = self.config.low_watermark - len(connected)
        for pid in list(self.discovered):
            if want <= 0:
                break
            failed = self._dial_failed.get(pid)
            if pid in connected or (failed is not None and now - failed < TOP_UP_RETRY_S) \
                    or not (addrs := node.addrs_of(pid)):
                continue
            try:
                await node.connect(PeerInfo(pid, addrs), timeout=min(5.0, self.config.dial_timeout))
                want -= 1
                self.top_up_dials += 1
                self._dial_failed.pop(pid, None)
            except ShardnetError as e:
                log.debug("could not dial discovered peer %s: %s", identity.short(pid), e)
                self._dial_failed[pid] = now
                if len(self._dial_failed) > MAX_DISCOVERED:
                    self._dial_failed.pop(next(iter(self._dial_failed)))


def _random_peer_id() -> ID:
    """A random point in the keyspace (the DHT only accepts peer-ID-shaped lookup keys)."""
    return identity.peer_id_of(identity.generate())
