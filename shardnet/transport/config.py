"""What a node needs to know to start. Plain data: the CLI and embedding apps both fill it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from libp2p.crypto.keys import KeyPair
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from .errors import AddressError
from .limits import Limits

#: Where servers listen unless told otherwise.
DEFAULT_SERVER_LISTEN = "/ip4/0.0.0.0/tcp/4001"


@dataclass
class NodeConfig:
    #: Explicit key pair (wins), else a key file path, else a fresh ephemeral identity.
    key_pair: KeyPair | None = None
    identity_path: Path | None = None
    listen: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce: list[str] = field(default_factory=list)
    bootstrap: list[str] = field(default_factory=list)
    #: "server" nodes store and answer DHT records; "client" nodes only query.
    dht_mode: str = "server"
    enable_quic: bool = False
    enable_mdns: bool = False
    #: Seconds for a dial (all addresses of one peer together).
    dial_timeout: float = 10.0
    #: Seconds for opening a stream and negotiating its protocol.
    stream_open_timeout: float = 10.0
    #: Seconds for one DHT query (get, find_providers, find_peer).
    dht_timeout: float = 15.0
    #: How often the node looks for new peers through the DHT: every ``discovery_interval`` s
    #: while it finds new ones (or wants connections), backing off to ``discovery_max_interval``.
    discovery_interval: float = 5.0
    discovery_max_interval: float = 3600.0
    #: Bootstrap reconnect backoff: first delay, cap.
    reconnect_initial: float = 0.5
    reconnect_max: float = 30.0
    #: Connection manager (connmgr.py): discovery dials up to ``low_watermark``; above
    #: ``high_watermark`` idle, unprotected connections older than ``connection_grace_s`` are
    #: closed down to ``low_watermark``.
    low_watermark: int = 32
    high_watermark: int = 128
    connection_grace_s: float = 30.0
    max_connections: int = 512
    #: gossipsub: heartbeat seconds and per-peer, per-topic message rate ceiling.
    pubsub_heartbeat: float = 1.0
    pubsub_max_msgs_per_topic_per_s: float = 1000.0
    #: Relays (/ip4/../tcp/../p2p/ID) to hold a slot at, so peers that cannot dial us reach us
    #: through them: our /p2p-circuit addresses are advertised with the others.
    relays: list[str] = field(default_factory=list)
    #: Serve circuit relay v2 (hop) for other peers within these limits (a RelayLimits);
    #: None: not a relay.
    relay_service: object | None = None
    #: Without ``relays``: once AutoNAT says we are private, hold slots at up to this many relays
    #: found among our peers (bootstrap nodes with --serve-relay, relays met through the DHT).
    auto_relays: int = 2
    #: Upgrade relayed connections to direct ones by DCUtR hole punching.
    hole_punch: bool = True
    #: Ask peers whether we are reachable (AutoNAT client), and answer them (service).
    autonat: bool = True
    #: Ask at all (the client): off for nodes whose reachability their operator knows (a
    #: bootstrap or relay on a public address: ``--no-autonat``); they still answer others.
    autonat_client: bool = True
    #: Seconds between AutoNAT checks once the answer is known (sooner while unknown).
    autonat_interval: float = 300.0
    #: Seconds between keepalive pings on each connection, and how long an unanswered one may
    #: stay unanswered before the connection counts as dead and is closed. On a connection whose
    #: streams write nothing the interval grows (half the time since one last wrote) up to
    #: ``keepalive_max_interval``; traffic of any kind stands in for pings (compat fix 10).
    keepalive_interval: float = 10.0
    keepalive_max_interval: float = 300.0
    keepalive_timeout: float = 15.0  # below interval + 10 s (py-libp2p waits 10 s for a pong, then pings anew)
    #: Raise glibc's mmap threshold for this process (see allocator.py): ~2.5x faster large
    #: transfers from the start. Off leaves the process allocator untouched.
    tune_allocator: bool = True
    #: A private swarm's key (a swarm_key.SwarmKey): only peers holding the same key connect.
    #: None: a public swarm (Noise, no admission step).
    swarm_key: object | None = None
    #: With a persistent identity (key_pair or identity_path): ask the bootstrap peers on start
    #: whether another live node uses it, and refuse to start if so (identity_check.py).
    check_identity: bool = True
    #: What this node allows each peer (streams, DHT records, activation sessions): limits.py.
    limits: Limits = field(default_factory=Limits)


def parse_multiaddr(text: str, *, what: str = "address") -> Multiaddr:
    try:
        return Multiaddr(text)
    except Exception as e:
        raise AddressError(f"malformed multiaddr for {what}: {text!r} ({e})") from None


def dial_place(addr: object) -> str:
    """An address as the place it dials: without its ``/p2p/<id>`` part, so an address held with
    and without it is one place (a relay circuit, whose ``/p2p`` parts say the way, is kept whole)."""
    text = str(addr)
    return text if "/p2p-circuit" in text else text.split("/p2p/")[0]


def peer_info(peer_id: str, addrs) -> PeerInfo:
    """A peer ID and its addresses as text (a claim's or a chain hop's); addresses that do not
    parse are skipped, a trailing /p2p/<peer_id> is dropped (a relay circuit keeps its inner
    /p2p/<relay>/p2p-circuit)."""
    from libp2p.peer.id import ID

    try:
        pid = ID.from_base58(peer_id)
    except Exception:
        raise AddressError(f"not a peer ID: {peer_id!r}") from None
    parsed = []
    for a in addrs:
        try:
            parsed.append(Multiaddr(a[:-len(f"/p2p/{peer_id}")] if a.endswith(f"/p2p/{peer_id}") else a))
        except Exception:
            continue
    return PeerInfo(pid, parsed)


def parse_peer_addr(text: str, *, what: str = "peer address") -> PeerInfo:
    """A dialable peer address: must end in /p2p/<peer-id>."""
    ma = parse_multiaddr(text, what=what)
    try:
        return info_from_p2p_addr(ma)
    except Exception:
        raise AddressError(f"{what} {text!r} has no /p2p/<peer-id> part") from None
