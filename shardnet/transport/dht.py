"""Kademlia DHT as shardnet uses it: bounded waits, signed values, de-duplicated providers.

Provider lookups scale with the number of providers of a key: a node answers GET_PROVIDERS with
a random sample of at most 20 of the providers it holds (compat fix 18), and ``find_providers``
returns ``count`` peers sampled at random from the union of what the closest peers answered, so
its cost and result stay bounded, and different lookups see different providers."""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from libp2p.kad_dht.common import BUCKET_SIZE
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service

from . import records
from .compat import kad as compat_kad
from .config import NodeConfig
from .errors import NotStoredError, OverlayTimeout, RecordError
from .limits import Refusals

log = logging.getLogger(__name__)

PROVIDER_DOMAIN = b"shardnet-provider/1:"


#: Kademlia's k: how many closest peers a walk finds and a record is stored at (py-libp2p's)
K = BUCKET_SIZE

#: seconds a walk's result (the servers closest to a key) is used again for another put, provide
#: or server listing towards the same key, as long as the routing table holds the same peers: a
#: claim refreshed every 200 s walked each time to the same servers (in a small swarm, a query to
#: every peer per refresh). Any peer joining or leaving the table makes the next one walk. An
#: hour, Kademlia's republication period: claims are refreshed and looked up every 1200 s.
WALK_REUSE_S = 3600.0
#: the least seconds between two times one unreachable peer drops the walks naming it
#: (``DHT.unreachable``)
UNREACHABLE_REWALK_S = 10.0
#: no reuse below this many peers in the routing table (py-libp2p's walks then also start from
#: every connected peer)
MIN_TABLE_FOR_REUSE = 5

#: a sha2-256 multihash's prefix (code 0x12, 32 bytes)
SHA256_MULTIHASH = b"\x12\x20"


def provider_key(name: str) -> str:
    """Provider records are keyed by a hash of the app's name, so any string is a valid key. The
    key is a sha2-256 multihash (hex), what other libp2p DHTs key providers by (a CID's
    multihash), so their nodes store, find and announce shardnet's providers too."""
    return (SHA256_MULTIHASH + hashlib.sha256(PROVIDER_DOMAIN + name.encode()).digest()).hex()


KAD_PROTOCOL = "/ipfs/kad/1.0.0"


def _meter_requests(kad, host, limits) -> None:
    """Requests other peers send us: at most ``dht_streams_per_peer`` streams at once per peer
    and ``dht_requests_per_peer`` messages per second (compat fix 14 counts each message read
    from a metered stream). Upstream allows 12 request streams at once *in all*, so one peer
    holding 12 idle streams shut everyone else out of this node's DHT."""
    from libp2p.custom_types import TProtocol

    from .limits import PeerCounts, TokenBuckets

    compat_kad.set_inbound_request_streams(kad, max(64, 4 * limits.dht_streams_per_peer))
    requests = TokenBuckets(limits.dht_requests_per_peer, limits.dht_burst_per_peer)
    open_streams = PeerCounts()
    refusals = Refusals()
    handle = kad.handle_stream

    async def metered(stream) -> None:
        peer = stream.muxed_conn.peer_id
        if open_streams[peer] >= limits.dht_streams_per_peer:
            refusals.note("dht_streams_per_peer", peer, f"limit dht_streams_per_peer: {str(peer)[:16]} has "
                                                        f"{open_streams[peer]} DHT streams open; resetting")
            await stream.reset()
            return
        open_streams[peer] += 1
        stream.kad_request_meter = (requests, peer, refusals)
        try:
            await handle(stream)
        finally:
            open_streams.release(peer)

    if kad.mode == DHTMode.SERVER:
        host.set_stream_handler(TProtocol(KAD_PROTOCOL), metered)
    kad.handle_stream = metered  # a later switch to server mode registers this one


def _cap_stored_records(store, limits) -> None:
    """Values other peers store with us: at most ``dht_records`` in all and
    ``dht_records_per_peer`` per publisher (upstream keeps 50,000 of up to 1 MiB each, and
    scans them all on every store). Over the cap a new key is not stored: a DHT store is best
    effort, and the publisher's other holders keep it. Replacing a stored value is always
    allowed (a peer refreshing its claim)."""
    put_record = store.put_record
    publishers: dict[bytes, str] = {}
    refusals = Refusals()

    def capped_put_record(key: bytes, record) -> None:
        if key not in store.store:
            for k in [k for k in publishers if k not in store.store]:
                del publishers[k]  # expired or evicted since
            try:
                publisher = str(records.decode(key.decode(), record.value).publisher)
            except Exception:
                publisher = "(not a shardnet record)"
            if len(store.store) >= limits.dht_records:
                refusals.note("dht_records", publisher, f"limit dht_records: DHT store full ({len(store.store)} values); "
                                                        f"not storing a new one from {publisher[:16]}")
                return
            held = sum(1 for p in publishers.values() if p == publisher)
            if held >= limits.dht_records_per_peer:
                refusals.note("dht_records_per_peer", publisher,
                              f"limit dht_records_per_peer: {publisher[:16]} already has {held} values stored here; not storing more")
                return
            publishers[key] = publisher
        put_record(key, record)

    store.put_record = capped_put_record


@dataclass(frozen=True)
class Published:
    """Where a record went: its DHT key, and how many peers besides us stored it."""

    key: str
    peers: int


class DHT:
    def __init__(self, kad: KadDHT, host, config: NodeConfig) -> None:
        self.kad = kad
        self.host = host
        self.timeout = config.dht_timeout
        #: per key walked for a put, a provide or servers_if_few: (routing table, when, closest)
        self._walks: dict[bytes, tuple[frozenset, float, list[ID]]] = {}
        #: peer -> when it last dropped the walks naming it (``unreachable``)
        self._unreachable: dict[str, float] = {}
        #: walks a put, provide or servers_if_few made, and how many it did not need (WALK_REUSE_S)
        self.walks = self.walks_saved = 0

    @classmethod
    @asynccontextmanager
    async def start(cls, host, config: NodeConfig) -> AsyncIterator[DHT]:
        mode = DHTMode.SERVER if config.dht_mode == "server" else DHTMode.CLIENT
        kad = KadDHT(host, mode, enable_random_walk=False)
        kad.register_validator(records.NAMESPACE, records.ShardnetRecordValidator())
        _cap_stored_records(kad.value_store, config.limits)
        _meter_requests(kad, host, config.limits)
        async with background_trio_service(kad):
            yield cls(kad, host, config)

    # -- peers -------------------------------------------------------------------------------
    async def add_peer(self, peer_id: ID) -> None:
        try:
            await self.kad.add_peer(peer_id)
        except Exception as e:
            log.debug("routing table refused %s: %s", peer_id, e)

    def remove_peer(self, peer_id: ID) -> None:
        self.kad.routing_table.remove_peer(peer_id)

    def routing_table_peers(self) -> list[ID]:
        return list(self.kad.routing_table.get_peer_ids())

    async def closest_peers(self, target: bytes, count: int = K) -> list[ID]:
        async with self._bounded("closest-peers lookup"):
            return list(await self.kad.peer_routing.find_closest_peers_network(target, count))

    async def _closest_again(self, key: bytes, count: int = K) -> list[ID]:
        """The servers closest to ``key``: a walk, or the last one's result towards the same key
        when it is under ``WALK_REUSE_S`` old and the routing table has the same peers."""
        table = frozenset(self.kad.routing_table.get_peer_ids())
        now = trio.current_time()
        last = self._walks.get(key)
        if last is not None and last[0] == table and now - last[1] < WALK_REUSE_S:
            self.walks_saved += 1
            return list(last[2])
        self.walks += 1
        closest = list(await self.kad.peer_routing.find_closest_peers_network(key, count))
        self._walks = {k: w for k, w in self._walks.items() if now - w[1] < WALK_REUSE_S}
        # With fewer than MIN_TABLE_FOR_REUSE peers in the table a walk also starts from the
        # connected peers (upstream), which the table does not show changing; an empty result
        # is no result: both walk again next time.
        if len(table) >= MIN_TABLE_FOR_REUSE and [p for p in closest if p != self.host.get_id()]:
            self._walks[key] = (table, now, closest)
        return closest

    def unreachable(self, peer: ID | str) -> None:
        """``peer``, which a walk named, could not be dialled: the walks that named it are not
        used again (a peer restarted with its identity on another port leaves the routing table
        looking the same, and a reused walk kept its old address; a new walk's answers carry
        where it listens now). At most once per peer per ``UNREACHABLE_REWALK_S``: a dead peer
        that other servers still name costs a walk that often, not one per lookup."""
        peer, now = str(peer), trio.current_time()
        if now - self._unreachable.get(peer, -math.inf) < UNREACHABLE_REWALK_S:
            return
        self._unreachable = {p: t for p, t in self._unreachable.items() if now - t < UNREACHABLE_REWALK_S}
        self._unreachable[peer] = now
        self._walks = {k: w for k, w in self._walks.items() if peer not in {str(p) for p in w[2]}}

    def _forget_walk(self, key: bytes) -> None:
        """The servers the last walk found took nothing: walk again next time."""
        self._walks.pop(key, None)

    async def find_peer(self, peer_id: ID) -> PeerInfo | None:
        async with self._bounded(f"find_peer {peer_id}"):
            return await self.kad.find_peer(peer_id)

    # -- signed values -----------------------------------------------------------------------
    async def put(self, name: str, value: bytes) -> Published:
        """Store ``value`` as ``name`` of ours, signed, here and at the DHT peers closest to its
        key; says where (``Published``). NotStoredError when no peer took it: a record kept only
        here is one nobody else finds (upstream's put_value says nothing either way)."""
        key = records.record_key(self.host.get_id(), name)
        blob = records.encode(self._key_pair(), name, value)
        key_bytes = key.encode()
        self.kad.validator.validate(key, blob)
        old = self.kad.value_store.get(key_bytes)
        if old is not None and old.value != blob and self.kad.validator.select(key, [blob, old.value]) != 0:
            raise RecordError(f"DHT record {name!r}: a newer value is stored already")
        self.kad.value_store.put(key_bytes, blob)
        async with self._bounded(f"put {key}"):
            closest = await self._closest_again(key_bytes)
            peers = await self._to_each(closest, lambda p: compat_kad.store_value_at(self.kad, p, key_bytes, blob))
        if not peers:
            self._forget_walk(key_bytes)
            raise NotStoredError(self._none_took(f"DHT record {name!r}", closest))
        return Published(key, peers)

    async def get(self, publisher: ID | str, name: str) -> bytes | None:
        """The newest valid value ``publisher`` stored under ``name``, or None."""
        key = records.record_key(publisher, name)
        async with self._bounded(f"get {key}"):
            blob = await self.kad.get_value(key)
        if blob is None:
            return None
        try:
            return records.decode(key, blob).data
        except RecordError as e:
            log.warning("discarding invalid record for %s: %s", key, e)
            return None

    # -- provider records --------------------------------------------------------------------
    async def provide(self, name: str) -> int:
        """Announce that we provide ``name`` (here, and to the DHT peers closest to it; republished
        as long as the node runs); how many peers it was sent to. NotStoredError when none."""
        store = self.kad.provider_store
        key = bytes.fromhex(provider_key(name))
        store.providing_keys.add(key)
        store.add_provider(key, PeerInfo(self.host.get_id(), list(self.host.get_addrs())))
        async with self._bounded(f"provide {name}"):
            closest = await self._closest_again(key)
            peers = await self._to_each(closest, lambda p: compat_kad.send_add_provider(store, p, key))
        if not peers:
            self._forget_walk(key)
            raise NotStoredError(self._none_took(f"provider record {name!r}", closest))
        return peers

    async def _to_each(self, peers: list[ID], send) -> int:
        """``send(peer)`` to every peer but us at once, each within half the DHT timeout; how many
        said yes."""
        me = self.host.get_id()
        ok = 0

        async def one(peer: ID) -> None:
            nonlocal ok
            with trio.move_on_after(self.timeout / 2):
                try:
                    ok += bool(await send(peer))
                except Exception as e:
                    log.debug("DHT store at %s failed: %s", peer, e)

        async with trio.open_nursery() as nursery:
            for peer in peers:
                if peer != me:
                    nursery.start_soon(one, peer)
        return ok

    def _none_took(self, what: str, closest: list[ID]) -> str:
        if not [p for p in closest if p != self.host.get_id()]:
            return f"{what}: no DHT peer to store it at (not connected to a swarm yet: wait_bootstrapped first)"
        return f"{what}: none of the {len(closest)} closest DHT peers stored it"

    async def servers_if_few(self) -> list[ID] | None:
        """Every DHT server, when a walk finds fewer than k (20): then no answer was cut short (a
        server names at most k peers), so it found them all, and a caller looking up many keys
        can ask each of them instead of walking once per key; None in a larger network (where a
        walk towards one ID can miss the servers farthest from it). One walk (towards our own ID),
        or none where the last one's result still holds (``WALK_REUSE_S``)."""
        async with self._bounded("closest-peers lookup"):
            found = await self._closest_again(self.host.get_id().to_bytes(), K)
        return found if len(found) < K else None

    async def find_providers(self, name: str, count: int = K, *, closest: list[ID] | None = None,
                             on_answer: Callable[[list[PeerInfo]], None] | None = None) -> list[PeerInfo]:
        """Providers of ``name``, each peer once with the union of its addresses: all found when
        they are at most ``count``, else ``count`` of them at random. The closest peers to the
        key each answer a random sample of at most 20 of the providers they hold, so where many
        peers provide a key a lookup finds a sample of them, and each lookup another one.
        ``closest``: the peers to ask (``servers_if_few``) instead of walking to the key's.
        ``on_answer``: called with each peer's answer as it comes (unsampled), so that a caller
        with a deadline can act on the first answers while a busy peer is still to answer."""
        key = bytes.fromhex(provider_key(name))
        store = self.kad.provider_store
        # py-libp2p's find_providers returns the local store alone whenever it is non-empty
        # (a node that holds one provider record never learns of the others) and can repeat a
        # provider. Ask the closest peers ourselves, then merge and de-duplicate.
        found = list(store.get_providers(key))
        async with self._bounded(f"find_providers {name}"):
            if closest is None:
                closest = await self.kad.peer_routing.find_closest_peers_network(key)
            me = self.host.get_id()

            async def ask(peer: ID) -> None:
                with trio.move_on_after(self.timeout / 2):
                    try:
                        providers, _closer = await compat_kad.providers_from_peer(store, peer, key)
                    except Exception as e:
                        log.debug("GET_PROVIDERS to %s failed: %s", peer, e)
                        return
                    found.extend(providers or [])
                    if on_answer is not None and providers:
                        on_answer(list(providers))

            async with trio.open_nursery() as nursery:
                for peer in closest:
                    if peer != me:
                        nursery.start_soon(ask, peer)
        merged: dict[ID, list] = {}
        for info in found:
            addrs = merged.setdefault(info.peer_id, [])
            for a in info.addrs:
                if a not in addrs:
                    addrs.append(a)
        found = [PeerInfo(pid, addrs) for pid, addrs in merged.items()]
        return found if len(found) <= count else random.sample(found, count)

    # -- helpers -----------------------------------------------------------------------------
    def _key_pair(self):
        from libp2p.crypto.keys import KeyPair

        return KeyPair(self.host.get_private_key(), self.host.get_public_key())

    @asynccontextmanager
    async def _bounded(self, what: str) -> AsyncIterator[None]:
        with trio.move_on_after(self.timeout) as scope:
            yield
        if scope.cancelled_caught:
            raise OverlayTimeout(f"DHT {what} timed out after {self.timeout:g} s")
