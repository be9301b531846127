"""Patches to py-libp2p's Kademlia DHT (``libp2p.kad_dht``), and the accessors for its private
state that dht.py needs.

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
14. A DHT request stream is read message after message with no limit on how many or how fast.
   Each message read from a stream the node meters (dht.py: inbound request streams) first takes
   a token from its peer's bucket (``dht_requests_per_peer``); without one the stream is reset.
18. A node holds at most 20 providers per key, the first 20 to announce themselves (later ones
   are dropped until one of those expires, 48 h on), and answers GET_PROVIDERS with all it holds.
   Where hundreds of peers provide one key (a layer range's claims, docs/protocols.md) every
   lookup then saw the same 20, never a peer that came later. A node now holds up to
   ``PROVIDERS_HELD_PER_KEY`` per key and answers with a random sample of at most
   ``PROVIDERS_PER_REPLY`` (k = 20) of them: a reply's size stays bounded, and different askers
   (and asks) see different providers.
19. The DHT refreshed its routing table every 10 minutes: a walk towards our own ID and one
   towards a random ID in every non-empty bucket, beside the node's own discovery walks
   (discovery.py), which walk towards our own ID and a random one. In a swarm of under k = 20
   servers each walk queries about every peer, so a 24-peer swarm's peers answered ~5 walks of
   each of the others every 10 minutes. Its loop now sleeps an hour
   (``ROUTING_TABLE_REFRESH_S``) and its refresh walks no more: discovery's walks are the
   node's Kademlia refresh (every 5 s while they find peers, then hourly at a random phase).
20. Every DHT message carries signed peer records (the sender's, and one per closer peer named),
   and each was unpacked and its ed25519 signature checked on arrival, though in a swarm the
   same few dozen records come back in every answer (24 peers: ~5 checks a second per idle
   peer, the largest part of its signature work). A record's bytes, once checked, are now
   remembered (``VERIFIED_RECORDS_HELD`` at most, least recently used out): the same bytes are
   the same valid signature, and a changed record is new bytes, checked in full.
"""

from __future__ import annotations

import random
from typing import Any

import trio
from libp2p.kad_dht.common import BUCKET_SIZE


# 11. DHT clients in routing tables -------------------------------------------------------------
def serves_dht(peerstore: Any, peer_id: Any) -> bool | None:
    """Whether the peer's identify lists the KAD protocol; None before identify has run."""
    from libp2p.kad_dht.common import PROTOCOL_ID

    try:
        protocols = peerstore.get_protocols(peer_id)
    except Exception:  # PeerStoreError: not in the peerstore (yet, or any more)
        return None
    return str(PROTOCOL_ID) in protocols if protocols else None


def add_only_servers_that_sent_requests() -> None:
    from libp2p.kad_dht.kad_dht import KadDHT

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
def query_only_servers() -> None:
    from libp2p.kad_dht.peer_routing import PeerRouting

    query = PeerRouting._query_single_peer_for_closest

    async def query_if_server(self, peer, target_key, new_peers) -> None:
        if serves_dht(self.host.get_peerstore(), peer) is not False:
            await query(self, peer, target_key, new_peers)

    PeerRouting._query_single_peer_for_closest = query_if_server


def return_only_servers() -> None:
    from libp2p.kad_dht.peer_routing import PeerRouting

    lookup = PeerRouting.find_closest_peers_network

    async def lookup_servers(self, target_key: bytes, count: int = BUCKET_SIZE) -> list:
        store = self.host.get_peerstore()
        return [p for p in await lookup(self, target_key, count) if serves_dht(store, p) is not False]

    PeerRouting.find_closest_peers_network = lookup_servers


# 14. DHT requests per peer ---------------------------------------------------------------------
class RequestRateExceeded(Exception):
    """A peer sent DHT requests faster than its limit."""


def meter_dht_requests() -> None:
    from libp2p.kad_dht import kad_dht

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


# 18. provider records: more held per key, a random sample answered -------------------------------
#: provider records a node holds per key (upstream: 20, the first to arrive)
PROVIDERS_HELD_PER_KEY = 4096
#: the most providers a GET_PROVIDERS reply names (Kademlia's k): a random sample of those held
PROVIDERS_PER_REPLY = BUCKET_SIZE


def hold_more_providers_per_key() -> None:
    from libp2p.kad_dht import provider_store

    provider_store.BUCKET_SIZE = PROVIDERS_HELD_PER_KEY  # (read there only by add_provider's cap)


# 19. routing table refresh ---------------------------------------------------------------------
#: seconds between the DHT's routing-table refreshes (upstream: 600)
ROUTING_TABLE_REFRESH_S = 3600


def refresh_the_routing_table_hourly() -> None:
    from libp2p.kad_dht import kad_dht

    kad_dht.ROUTING_TABLE_REFRESH_INTERVAL = ROUTING_TABLE_REFRESH_S  # (read by its loop each round)


def leave_routing_table_refresh_to_discovery() -> None:
    from libp2p.kad_dht.kad_dht import KadDHT

    async def refresh_routing_table(self) -> None:
        return None  # discovery.py walks towards our own ID and a random one, on its schedule

    KadDHT.refresh_routing_table = refresh_routing_table


# 20. signed peer records checked once ---------------------------------------------------------
#: signed peer records (envelope bytes) whose signature was checked, kept for their next arrival
VERIFIED_RECORDS_HELD = 4096


def check_each_peer_record_once() -> None:
    from collections import OrderedDict

    from libp2p.kad_dht import utils

    consume = utils.consume_envelope
    checked: OrderedDict[tuple[bytes, str], tuple] = OrderedDict()

    def consume_once(data: bytes, domain: str) -> tuple:
        key = (bytes(data), domain)
        hit = checked.get(key)
        if hit is not None:
            checked.move_to_end(key)
            return hit
        checked[key] = out = consume(data, domain)  # (raises on a bad signature: never held)
        if len(checked) > VERIFIED_RECORDS_HELD:
            checked.popitem(last=False)
        return out

    utils.consume_envelope = consume_once


def answer_a_sample_of_providers() -> None:
    from libp2p.kad_dht.provider_store import ProviderStore

    get_providers = ProviderStore.get_providers

    def sampled_providers(self, key: bytes) -> list:
        # what the GET_PROVIDERS handler answers (and what a node reads of its own store)
        providers = get_providers(self, key)
        if len(providers) <= PROVIDERS_PER_REPLY:
            return providers
        return random.sample(providers, PROVIDERS_PER_REPLY)

    ProviderStore.get_providers = sampled_providers


# accessors: the DHT's private state, read only here --------------------------------------------
def set_inbound_request_streams(kad: Any, total: int) -> None:
    """How many inbound request streams the KadDHT serves at once, from all peers together
    (upstream: 12)."""
    kad._inbound_limiter = trio.CapacityLimiter(total)


async def store_value_at(kad: Any, peer: Any, key: bytes, value: bytes) -> bool:
    """One PUT_VALUE to ``peer``: whether it answered that it stored the value."""
    return bool(await kad.value_store._store_at_peer(peer, key, value))


async def send_add_provider(store: Any, peer: Any, key: bytes) -> bool:
    """One ADD_PROVIDER to ``peer`` (fire and forget, as the spec's implementations treat it):
    whether it was sent."""
    return bool(await store._send_add_provider(peer, key))


async def providers_from_peer(store: Any, peer: Any, key: bytes) -> tuple[Any, Any]:
    """One GET_PROVIDERS request to ``peer``: (providers, closer peers) as the provider store
    gets them."""
    return await store._get_providers_from_peer_with_closers(peer, key)
