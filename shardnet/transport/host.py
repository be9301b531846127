"""Build the py-libp2p host with shardnet's settings (TCP + Noise + Yamux, QUIC behind a flag).

The settings here are the configuration-level fixes for py-libp2p 0.8.1 (see compat/ for the
patches):

- ``max_connections_per_peer=1``: with the default 3, every dial waits a 250 ms "happy
  eyeballs" delay for parallel attempts we never want.
- the auto-connector off and watermarks at our own (small) targets: it would dial every known
  peer up to ~100 connections; shardnet's discovery loop tops up to ``low_watermark`` instead.
- dial retries off: shardnet retries on its own schedule with backoff (bootstrap supervision),
  and a dead peer must fail its dial quickly rather than after three backed-off attempts.
- security is Noise only (py-libp2p also offers plaintext, which authenticates nobody, and
  secio), or the private-swarm protocol when a swarm key is set (security.py).
- pings are answered in batches (``ping_answerer``): py-libp2p writes one reply per 32-byte ping,
  so 8 KiB sent at once cost 256 encrypted writes (a tenth of a victim's CPU under a garbage
  flood, measured).
- fixed listen ports are probed first: py-libp2p sets SO_REUSEPORT on its listeners, so a
  second node on the same port would bind silently and steal half the connections.
"""

from __future__ import annotations

import errno
import logging
import socket

import trio
from libp2p import new_host
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig, RetryConfig
from multiaddr import Multiaddr

from .config import NodeConfig
from .errors import PortInUseError
from .limits import ConnectionGate, PeerCounts, StreamGate
from .security import guard_upgrader, security_options

log = logging.getLogger(__name__)


def connection_config(config: NodeConfig) -> ConnectionConfig:
    return ConnectionConfig(
        max_connections_per_peer=1,
        max_connections=config.max_connections,
        min_connections=0,
        low_watermark=config.low_watermark,
        high_watermark=config.high_watermark,
        dial_timeout=config.dial_timeout,
    )


def build_host(config: NodeConfig, key_pair: KeyPair, announce: list[Multiaddr]):
    from libp2p.rcmgr import new_resource_manager
    from libp2p.rcmgr.manager import ResourceLimits

    host = new_host(
        key_pair=key_pair,
        connection_config=connection_config(config),
        enable_quic=config.enable_quic,
        enable_mDNS=config.enable_mdns,
        announce_addrs=announce or None,
        addrs_factory=None if announce else expand_unspecified,
        sec_opt=security_options(key_pair, config.swarm_key),
        resource_manager=new_resource_manager(limits=ResourceLimits(
            max_connections=config.max_connections, max_streams=config.limits.streams_total)),
    )
    swarm = host.get_network()
    swarm.stream_gate = StreamGate(config.limits)  # per-peer stream limits (compat fix 12)
    swarm.handshake_timeout = config.limits.handshake_s  # inbound upgrade deadline (compat fix 13)
    swarm.connection_rate = ConnectionGate(config.limits)  # per-IP inbound connection rate (fix 13)
    host.set_stream_handler(TProtocol(PING_PROTOCOL), ping_answerer(config.limits.ping_streams_per_peer))
    if config.swarm_key is not None:
        guard_upgrader(swarm.upgrader, host.get_id())
    swarm.retry_config = RetryConfig(max_retries=0)
    # shardnet's discovery loop owns connection top-up (bounded by low_watermark); the
    # auto-connector would otherwise dial every known peer up to the watermark midpoint.
    swarm.auto_connector.run_background_task = _no_auto_connector
    swarm.auto_connector.maybe_connect = _no_auto_connector
    return host


async def _no_auto_connector(*_args) -> None:
    return None


PING_PROTOCOL = "/ipfs/ping/1.0.0"
PING_BYTES = 32
PING_IDLE_S = 10.0


def ping_answerer(streams_per_peer: int = 8):
    """A handler for one host (it counts each peer's ping streams; at most ``streams_per_peer``,
    the limit ``ping_streams_per_peer``)."""
    streams = PeerCounts()

    async def handler(stream) -> None:
        await answer_pings(stream, streams, streams_per_peer)

    return handler


async def answer_pings(stream, open_streams: PeerCounts, streams_per_peer: int = 8) -> None:
    """libp2p ping: every 32 bytes received are sent back. All complete pings that arrived
    together go back in one write (the same bytes, in order); a stream idle for 10 s is closed;
    at most ``streams_per_peer`` ping streams per peer (py-libp2p's own handler allows 2, which
    concurrent requests of one busy client ran into: a reset ping then looked like a dead peer)."""
    peer = stream.muxed_conn.peer_id
    if open_streams[peer] >= streams_per_peer:
        await stream.reset()
        return
    open_streams[peer] += 1
    pending = b""
    try:
        while True:
            with trio.move_on_after(PING_IDLE_S):
                data = await stream.read(64 << 10)
                if not data:
                    break
                pending += data
                whole = len(pending) - len(pending) % PING_BYTES
                if whole:
                    await stream.write(pending[:whole])
                    pending = pending[whole:]
                continue
            break  # idle
        await stream.close()
    except Exception:
        try:
            await stream.reset()
        except Exception:
            pass
    finally:
        open_streams.release(peer)


def interface_ips() -> list[str]:
    """Every IPv4 and IPv6 address of this machine's interfaces, loopback included."""
    import ifaddr

    ips: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            addr = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            if "%" in addr or addr.startswith("fe80"):
                continue  # link-local addresses are not dialable without a scope
            if addr not in ips:
                ips.append(addr)
    return ips


def expand_unspecified(candidates: list[Multiaddr]) -> list[Multiaddr]:
    """Advertise 0.0.0.0 / :: listeners as one address per interface, as go-libp2p does."""
    out: list[Multiaddr] = []
    ips = None
    for ma in candidates:
        text = str(ma)
        for family, wildcard in (("ip4", "/ip4/0.0.0.0/"), ("ip6", "/ip6/::/")):
            if text.startswith(wildcard):
                ips = interface_ips() if ips is None else ips
                rest = text[len(wildcard):]
                for ip in ips:
                    if (":" in ip) == (family == "ip6"):
                        out.append(Multiaddr(f"/{family}/{ip}/{rest}"))
                break
        else:
            out.append(ma)
    seen: set[str] = set()
    return [m for m in out if not (str(m) in seen or seen.add(str(m)))]


def check_listen_ports(listen: list[Multiaddr]) -> None:
    """Refuse a fixed TCP/UDP port that another process already listens on."""
    for ma in listen:
        protos = [p.name for p in ma.protocols()]
        for transport, kind in (("tcp", socket.SOCK_STREAM), ("udp", socket.SOCK_DGRAM)):
            if transport not in protos:
                continue
            port = int(ma.value_for_protocol(transport))
            if port == 0:
                continue
            if "ip6" in protos:
                family, ip = socket.AF_INET6, ma.value_for_protocol("ip6")
            elif "ip4" in protos:
                family, ip = socket.AF_INET, ma.value_for_protocol("ip4")
            else:
                continue
            _probe_bind(family, kind, ip, port, ma)


def _probe_bind(family: int, kind: int, ip: str, port: int, ma: Multiaddr) -> None:
    # Without SO_REUSEPORT this bind fails if any socket (reuseport or not) holds the port.
    # SO_REUSEADDR keeps TIME_WAIT leftovers of our own earlier runs from counting.
    s = socket.socket(family, kind)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port))
        if kind == socket.SOCK_STREAM:
            s.listen(1)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(f"{ma}: port {port} is already in use by another process") from None
        raise PortInUseError(f"{ma}: cannot bind: {e.strerror}") from None
    finally:
        s.close()
