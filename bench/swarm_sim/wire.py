"""What the swarm's control messages weigh on the wire (bytes), for the simulation's counts.

A claim's size is measured: ``block_claim.encode`` of a representative claim, signed with a
real Ed25519 key (a 52-character peer ID, a 64-hex model ID, two addresses: a public peer's TCP
and QUIC ones, or a NATed peer's LAN address and a relay circuit; one successor round trip per
``rtts`` entry), once per shape. The rest are estimates from the protocols' formats, each said
where it is defined:

- every message pays ``FRAME`` bytes below the protocol: TCP/IP headers (40), a Noise transport
  frame (2 bytes of length, a 16-byte tag) and a yamux header (12);
- a request on a new stream (a DHT RPC, a direct claim request) pays ``STREAM_OPEN`` more:
  multistream-select's header and the protocol ID, each way;
- a DHT RPC (py-libp2p's Kademlia protobufs): a request names a key (``DHT_KEY``); an answer to
  a walk's step carries ``DHT_K`` closer peers of ``PEER_INFO`` bytes each (a 38-byte binary
  peer ID and two binary multiaddrs, with protobuf tags); a PUT_VALUE carries the record (the
  claim and its key) and is echoed back; an ADD_PROVIDER carries one peer info;
- a gossipsub message carries the claim in an RPC with its topic, sender, sequence number and
  signature (``GOSSIP_ENVELOPE``); IHAVE/IWANT and heartbeats are not counted;
- a ping is 32 bytes each way (libp2p's ping protocol) on an open connection; to a peer this node
  holds no connection to, the dial comes first (``DIAL``: TCP handshake, multistream, the Noise
  XX handshake with its identity payloads, yamux, and identify's answer with addresses, protocols
  and a signed peer record).

A "message" in the counts is one request with its answer (a DHT RPC, a ping and its pong, a
direct claim request and its reply) or one gossip delivery.
"""

from __future__ import annotations

import functools
import hashlib

from shardnet.protocols import block_claim as bc

FRAME = 40 + 18 + 12
STREAM_OPEN = 2 * 40
DHT_KEY = 60
PEER_INFO = 38 + 2 * 20 + 12
GOSSIP_ENVELOPE = len(bc.PROTOCOL_ID) + 65 + 38 + 8 + 64 + 16
PING = 2 * (32 + FRAME)
DIAL = 3000

#: Kademlia replication (py-libp2p's BUCKET_SIZE): the peers a walk's answers name, and the peers
#: a put stores at
DHT_K = 20


@functools.lru_cache(maxsize=1)
def _signer():
    from libp2p.peer.id import ID

    from shardnet.transport.identity import create_new_key_pair

    key = create_new_key_pair(b"\x01" * 32)
    return key, str(ID.from_pubkey(key.public_key))


@functools.lru_cache(maxsize=None)
def claim_bytes(reach: str, rtts: int, loading: bool) -> int:
    """The encoded size of a representative claim of this shape (measured with the real encoder)."""
    key, peer = _signer()
    other = "12D3KooW" + "A" * 44  # a peer ID's length
    if reach == "public":
        addrs = (f"/ip4/203.0.113.7/tcp/31337/p2p/{peer}", f"/ip4/203.0.113.7/udp/31337/quic-v1/p2p/{peer}")
    else:
        addrs = ("/ip4/192.168.1.20/tcp/31337", f"/ip4/198.51.100.4/tcp/4001/p2p/{other}/p2p-circuit/p2p/{peer}")
    claim = bc.Claim(model=hashlib.sha256(b"model").hexdigest(), start=17, end=29, kv_tokens=123_456,
                     tput=38.123456789, addrs=addrs, expires=1_796_000_000.123, peer=peer, reach=reach,
                     load=0.123456789, rtts=tuple((other, 0.0123456789) for _ in range(rtts)),
                     dtype="bfloat16", quant="int4", since=1_795_990_000.5, loading=(30, 41) if loading else None,
                     seq=1_795_990_123_456)
    return len(bc.encode(key, claim))


def size_of(claim: bc.Claim) -> int:
    return claim_bytes(claim.reach, min(len(claim.rtts), bc.MAX_RTTS), claim.loading is not None)


def walk_rpc() -> int:
    """One step of a DHT walk: a request for a key, an answer with ``DHT_K`` closer peers."""
    return (STREAM_OPEN + DHT_KEY + FRAME) + (DHT_K * PEER_INFO + FRAME)


def put_rpc(claim: int) -> int:
    """PUT_VALUE of a claim record, echoed back."""
    return 2 * (STREAM_OPEN // 2 + DHT_KEY + claim + 16 + FRAME)


def provide_rpc() -> int:
    """ADD_PROVIDER: the key and this peer's info (no answer)."""
    return STREAM_OPEN + DHT_KEY + PEER_INFO + FRAME


def gossip(claim: int) -> int:
    """One delivery of a claim on gossipsub."""
    return claim + GOSSIP_ENVELOPE + FRAME


def direct_request(claim: int) -> int:
    """A direct claim request (a new stream) and its reply (a CBOR list of one claim)."""
    return (STREAM_OPEN + FRAME) + (claim + 4 + FRAME)
