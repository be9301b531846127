"""Finding block claims (through the DHT and direct requests): what the server publishes under
(``claim_record_name``, ``range_provider_name`` of the layer range holding its first layer) and what
clients, compute peers and status queries look up (``find_claims``: the providers of each layer
range, then each provider asked directly; docs/protocols.md, "Claim dissemination")."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable

import cbor2
import trio

from shardnet.errors import ShardnetError
from shardnet.protocols import block_claim as bc
from shardnet.transport.errors import DialError
from shardnet.transport.node import Node

log = logging.getLogger(__name__)

#: how long a claim is valid: its publisher puts it in the DHT again every third of this (with the
#: same version), and gossips only news (docs/protocols.md). Not how a peer's death is found:
#: connections close (keepalive, or at once when its process exits) and clients probe what they
#: route through, so a claim may outlive its peer by most of an hour. Kademlia's hourly
#: republication: at 600 s, the refreshes and the lookups that carry them were most of an idle
#: 24-peer swarm's control traffic (docs/performance.md, issue 37)
CLAIM_TTL = 3600.0
MAX_CLAIMS_PER_REPLY = 16


def claim_record_name(model_id: str) -> str:
    return f"claim/{model_id}"


def provider_name(model_id: str) -> str:
    """The model-wide provider key (dissemination 1: no longer provided under nor looked up)."""
    return f"model/{model_id}"


def range_provider_name(model_id: str, index: int) -> str:
    """The provider key of one layer range of a model (``block_claim.layer_ranges``): a claim is
    provided under the range holding its first layer (``block_claim.claim_ranges``; dissemination 2)."""
    return f"model/{model_id}/r{index}"


#: a lookup of one layer range asks the DHT for at most this many of its providers (a sample in
#: a large swarm), then each of them directly
LOOKUP_PROVIDERS_PER_RANGE = 16
#: what ``shardnet status`` and the model listing take of each range: every provider the DHT
#: names (each of the key's closest peers answers at most 20 at random), so that they list a
#: small swarm's every peer, where a sample of 16 missed some (a range's providers include the
#: peers that left it: provider records cannot be withdrawn)
STATUS_PROVIDERS_PER_RANGE = 400
#: how many ranges' provider lookups run at once: in a swarm of under 20 DHT servers every range's
#: walk asks every server, and more at once ran into their ``dht_streams_per_peer`` (8)
LOOKUP_RANGES_AT_ONCE = 4


# Round trips are the least of a few pings: one sample can land behind a busy moment at either
# end (a loaded event loop adds tens of ms), and routing compares them across peers.
RTT_SAMPLES = 3


async def live_claims(node: Node, claims: list[bc.Claim], *, timeout: float = 3.0,
                      connected_are_live: bool = False, ping_most: int | None = None) -> list[bc.Claim]:
    """The claims whose peers answer a ping now (a claim outlives its peer until it expires).
    ``connected_are_live``: a peer we hold a connection to counts as live without a ping (its
    keepalive closes the connection within ``keepalive_max_interval + keepalive_timeout`` of the
    peer going silent, and a process that exits closes it at once); of the others, only the
    first ``ping_most`` (in the order given; None: all) are pinged, the rest trusted until
    their claims expire."""
    if connected_are_live:
        linked = {c.peer for c in claims if node.link(c.peer) is not None}
        others = [c for c in claims if c.peer not in linked]
        most = len(others) if ping_most is None else ping_most
        pinged = await live_claims(node, others[:most], timeout=timeout)
        return [c for c in claims if c.peer in linked] + pinged + others[most:]
    pings = await node.ping_many([c.peer for c in claims], timeout=timeout)
    for peer, p in pings.items():
        if p.rtt is None:
            log.debug("claim of %s ignored: no answer to a ping (%s)", peer[:16], p.error)
    return [c for c in claims if pings[c.peer].rtt is not None]


async def fetch_claims(node: Node, peer: str, *, timeout: float = 10.0) -> list[bc.Claim]:
    """Ask one peer directly for its current claims."""
    async with await node.new_stream(peer, bc.PROTOCOL_ID, timeout=timeout) as s:
        data = b""
        with trio.fail_after(timeout):
            while chunk := await s.read_some(65536, timeout=timeout):
                data += chunk
                if len(data) > MAX_CLAIMS_PER_REPLY * bc.MAX_CLAIM_BYTES:
                    raise ShardnetError("claim reply too large")
    blobs = cbor2.loads(data) if data else []
    out = []
    for blob in blobs[:MAX_CLAIMS_PER_REPLY] if isinstance(blobs, list) else []:
        try:
            c = bc.decode(blob)
        except bc.ClaimError as e:
            log.info("ignoring claim from %s: %s", peer[:16], e)
            continue
        if c.peer == peer:
            out.append(c)
    return out


async def find_claims(node: Node, model_id: str, *, num_layers: int, ranges: Iterable[int] | None = None,
                      per_range: int = LOOKUP_PROVIDERS_PER_RANGE, timeout: float = 15.0,
                      every_provider: bool = False, answered: set[str] | None = None) -> list[bc.Claim]:
    """The claims for ``model_id`` of the peers the DHT knows as providers of its layer ranges
    (``ranges``: indices into ``block_claim.layer_ranges(num_layers)``; all by default), verified.
    The ranges' providers are looked up together (``LOOKUP_RANGES_AT_ONCE`` at a time), at most
    ``per_range`` per range (a random sample where there are more: a view's lookups take
    ``LOOKUP_PROVIDERS_PER_RANGE``, ``shardnet status`` every provider the DHT names,
    ``STATUS_PROVIDERS_PER_RANGE``); each peer found is asked directly once, as soon as a range
    names it (whatever other ranges name it too), its DHT record read when it does not answer.
    In a network of fewer than k DHT servers one walk finds every server
    (``dht.servers_if_few``), and each is asked directly instead, without provider records
    (a compute peer is a DHT server; one that does not answer, or serves no claims, is skipped),
    unless ``every_provider`` (``shardnet status``: the claims of peers gone too, read from the
    DHT, until they expire). ``answered``: filled with the peers that answered the direct
    request themselves (a claim read from the DHT may be a gone peer's last). Raises the
    lookup's error only when every range's provider lookup failed and no claim was found."""
    ranges = range(len(bc.layer_ranges(num_layers))) if ranges is None else sorted(set(ranges))
    claims: dict[str, bc.Claim] = {}
    asked: set[str] = set()
    errors: list[ShardnetError] = []
    at_once = trio.CapacityLimiter(LOOKUP_RANGES_AT_ONCE)

    def ask_each(found: list, nursery: trio.Nursery) -> None:
        for info in found:
            if str(info.peer_id) not in asked:
                asked.add(str(info.peer_id))
                nursery.start_soon(claims_of, info.peer_id, info.addrs)

    async def providers_of(index: int, nursery: trio.Nursery, servers: list | None) -> None:
        # every provider wanted (``shardnet status``): each is asked as soon as a DHT peer names
        # it, so that one busy peer's late answer does not hold up the claims of all the others
        # (a status look while 24 peers settled on 2 cores found nobody within its 5 s)
        every = per_range >= STATUS_PROVIDERS_PER_RANGE
        heard = []

        def on_answer(infos: list) -> None:
            heard.append(True)
            ask_each(infos, nursery)

        try:
            async with at_once:
                found = await node.dht.find_providers(range_provider_name(model_id, index), count=per_range,
                                                      closest=servers, on_answer=on_answer if every else None)
        except ShardnetError as e:
            log.debug("providers of range %d of %s: %s", index, model_id[:16], e)
            if not heard:  # (a lookup that timed out after some answers came did not fail)
                errors.append(e)
            return
        ask_each(found, nursery)

    async def claims_of(peer_id, addrs: list, provider: bool = True) -> None:
        # the peer itself first (one stream, its freshest claim); a provider's DHT record (a
        # walk of the DHT) only when it does not answer
        pid = str(peer_id)
        if addrs:
            node.host.get_peerstore().add_addrs(peer_id, addrs, 600)
        try:
            got = await fetch_claims(node, pid, timeout=timeout / 2)
        except (ShardnetError, trio.TooSlowError) as e:
            log.debug("direct claim request to %s: %s", pid[:16], e)
            got = []
            if isinstance(e, DialError) and pid not in {str(p) for p in node.peers()}:
                # (a walk reused for the server list may name it where it listened before a
                # restart: the next lookup walks again, and its answers say where it is now)
                node.dht.unreachable(peer_id)
        if got and answered is not None:
            answered.add(pid)
        if not got and provider:
            try:
                blob = await node.dht.get(pid, claim_record_name(model_id))
                got = [bc.decode(blob)] if blob else []
            except (ShardnetError, bc.ClaimError) as e:
                log.debug("DHT claim of %s: %s", pid[:16], e)
        for c in got:
            if c.model == model_id and c.peer == pid:
                claims[c.peer] = c

    with trio.move_on_after(timeout):
        # in a network of fewer than k DHT servers, ask them all: one walk and a stream each,
        # where GET_PROVIDERS to each server per range cost 2-3 times that
        servers = None
        try:
            servers = None if every_provider else await node.dht.servers_if_few()
        except ShardnetError as e:  # then a walk per range
            log.debug("closest-peers walk: %s", e)
        async with trio.open_nursery() as nursery:
            if servers is not None:
                me = str(node.peer_id)
                for peer in servers:  # (identify may predate a peer's claims: every server is asked)
                    if str(peer) != me:
                        nursery.start_soon(claims_of, peer, [], False)
            else:
                for index in ranges:
                    nursery.start_soon(providers_of, index, nursery, None)
    if ranges and len(errors) == len(ranges) and not claims:
        raise errors[0]
    if servers is None:
        return list(claims.values())
    # every server asked: per range asked for, the claims there (``per_range`` of them at most)
    out: dict[str, bc.Claim] = {}
    for index in ranges:
        there = [c for c in claims.values() if index in bc.claim_ranges(c, num_layers)]
        out.update((c.peer, c) for c in (random.sample(there, per_range) if len(there) > per_range else there))
    return list(out.values())
