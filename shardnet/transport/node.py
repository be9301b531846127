"""A running overlay node: host, DHT, gossipsub and the behaviours composed on them.

``open_node`` is the one entry point; everything it starts lives in its nursery and stops when the
``async with`` block ends. Every background duty is a behaviour (behaviour.py) with a ``snapshot()``
of its state: the core ones every node runs (bootstrap supervision, discovery, keepalive, the connection manager) and the
pluggable ones it is given (the NAT services by default, an app's own).
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass
from typing import TypeVar

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.stream_muxer.exceptions import MuxedStreamReset
from multiaddr import Multiaddr

from . import allocator, compat, identity, identity_check
from .behaviour import Behaviour, NodeBehaviour
from .bootstrap import BootstrapSupervisor
from .config import NodeConfig, parse_multiaddr, parse_peer_addr, peer_info
from .connmgr import ConnectionManager
from .dht import DHT
from .discovery import Discovery
from .errors import DialError, HeldError, OverlayTimeout, ProtocolNotSupported, ShardnetError, StreamLimitError
from .host import build_host, check_listen_ports
from .keepalive import Keepalive
from .limits import Limits
from .nat.autonat import AutoNAT, AutoNATStatus
from .nat.holepunch import HolePuncher, HolePunchStatus
from .nat.relay import RelayClient, RelayClientStatus, RelayService, is_relayed, parse_circuit_addr
from .pubsub import PubSub
from .security import admission_reason
from .stream import Stream

log = logging.getLogger(__name__)

StreamHandler = Callable[[Stream], Awaitable[None]]
B = TypeVar("B")
E = TypeVar("E", bound=BaseException)

PING_PROTOCOL = TProtocol("/ipfs/ping/1.0.0")


@dataclass(frozen=True)
class PeerEvent:
    kind: str  # "discovered" | "connected" | "disconnected"
    peer_id: ID


class _ConnectionEvents:
    """py-libp2p network notifee that turns (dis)connections into PeerEvents."""

    def __init__(self, node: Node) -> None:
        self.node = node

    async def connected(self, network, conn) -> None:
        self.node.emit(PeerEvent("connected", conn.muxed_conn.peer_id))

    async def disconnected(self, network, conn) -> None:
        self.node.emit(PeerEvent("disconnected", conn.muxed_conn.peer_id))

    async def opened_stream(self, network, stream) -> None:
        pass

    async def closed_stream(self, network, stream) -> None:
        pass

    async def listen(self, network, multiaddr) -> None:
        pass

    async def listen_close(self, network, multiaddr) -> None:
        pass


#: Seconds for the direct addresses of a peer that also advertises relay circuits.
DIRECT_FIRST = 3.0
#: the most dials of one connect (``_connect_direct``): py-libp2p dials one address per transport,
#: the first it holds; after a failure the next held address is dialled, this many in all
MAX_DIAL_ROUNDS = 4
#: Seconds open_node waits for a first bootstrap connection to check our identity is not live
#: elsewhere before handing out the node (later connections are checked in the background).
IDENTITY_CHECK_WAIT = 3.0


@dataclass(frozen=True)
class PingResult:
    rtt: float | None  # seconds; None when the peer did not answer
    seconds: float  # how long the answer (or the failure) took
    error: BaseException | None

class Node:
    """The overlay as an embedding app sees it."""

    def __init__(self, config: NodeConfig, key_pair: KeyPair, host, dht: DHT, pubsub: PubSub,
                 bootstrap: list[PeerInfo] = ()):
        self.config = config
        self.key_pair = key_pair
        self.host = host
        self.dht = dht
        self.pubsub = pubsub
        self._peer_watchers: list[trio.MemorySendChannel[PeerEvent]] = []
        #: streams our handlers served, by (protocol, "direct" | "relayed")
        self.streams_served: Counter[tuple[str, str]] = Counter()
        #: The core behaviours, which every node runs (open_node starts them; they are not in
        #: ``behaviours``, the pluggable ones). Attached at once: each may use the others.
        self.bootstrap = BootstrapSupervisor(list(bootstrap), config)
        self.discovery = Discovery(config, lambda peer: self.emit(PeerEvent("discovered", peer)))
        self.keepalive = Keepalive(config)
        self.connection_manager = ConnectionManager(config)
        for core in self.core_behaviours:
            core.attach(self)
        #: set (and replaced) whenever a connection opens or closes or a bootstrap dial fails
        self._links_changed = trio.Event()
        #: the behaviours attached to the node, in the order they were added (see behaviour.py)
        self._behaviours: list[object] = []
        #: the inference layer's node-wide services (``shardnet.inference.services.InferenceServices``,
        #: made once by ``inference_services(node)`` and shared by the compute peer and the clients
        #: on this node); transport never reads it, and keeps no other registry of services
        self.inference: object | None = None
        self._behaviour_scopes: dict[int, trio.CancelScope] = {}
        self._closing = False
        #: the node's own nursery (set while the node runs): background work it owns
        self.nursery: trio.Nursery | None = None
        #: set once open_node has started every behaviour it was given (before it yields the node)
        self.started = trio.Event()

    # -- behaviours --------------------------------------------------------------------------
    @property
    def core_behaviours(self) -> list[Behaviour]:
        """What every node runs: bootstrap supervision, discovery, keepalive, the connection manager."""
        return [self.bootstrap, self.discovery, self.keepalive, self.connection_manager]

    def behaviour(self, cls: type[B]) -> B | None:
        """The node's (pluggable) behaviour of type ``cls``, or None."""
        for b in self._behaviours:
            if isinstance(b, cls):
                return b
        return None

    @property
    def behaviours(self) -> list[object]:
        """The pluggable behaviours, in the order they were added (the core ones are not here)."""
        return list(self._behaviours)

    async def add_behaviour(self, b: B) -> B:
        """Start ``b`` in the node's nursery and return it once it says it is ready (its ``run``
        called ``task_status.started()``); an error it raises before that is raised here."""
        nursery = self._running_nursery(b)
        self._behaviours.append(b)
        try:
            await nursery.start(self._run_behaviour, b)
        except BaseException:
            self._forget_behaviour(b)
            raise
        return b

    def ensure_behaviour(self, cls: type[B], factory: Callable[[], B] | None = None) -> B:
        """The node's ``cls`` behaviour, made with ``factory`` (default ``cls(node)``) and started
        in the background if there is none yet: for callers that cannot wait (constructors). The
        factory registers the behaviour's handlers at once; its ``run`` starts with
        ``nursery.start_soon``, so nothing waits for it to be ready."""
        found = self.behaviour(cls)
        if found is not None:
            return found
        b = factory() if factory is not None else cls(self)
        if not hasattr(b, "run"):
            raise TypeError(f"{cls.__name__} has no run: it is not a behaviour")
        nursery = self._running_nursery(b)
        self._behaviours.append(b)
        nursery.start_soon(self._run_behaviour, b)
        return b

    def remove_behaviour(self, b: object) -> None:
        """Stop ``b`` (its ``run`` is cancelled) and forget it."""
        scope = self._behaviour_scopes.get(id(b))
        if scope is not None:
            scope.cancel()
        self._forget_behaviour(b)

    def _running_nursery(self, b: object) -> trio.Nursery:
        if self.nursery is None:
            raise ShardnetError(f"cannot start {type(b).__name__}: the node is not running")
        return self.nursery

    async def _run_behaviour(self, b, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self._behaviour_scopes[id(b)] = scope
            try:
                await b.run(self, task_status=task_status)
            finally:
                # A stopped node keeps its behaviours readable (stats); one removed (and maybe
                # added again since) was forgotten by remove_behaviour.
                if not self._closing and self._behaviour_scopes.get(id(b)) is scope:
                    self._forget_behaviour(b)

    def _forget_behaviour(self, b: object) -> None:
        self._behaviour_scopes.pop(id(b), None)
        self._behaviours = [x for x in self._behaviours if x is not b]

    # Read-only views of the default behaviours, for the code that reads them by name.
    @property
    def relay_client(self) -> RelayClient | None:
        """Accepts circuits through relays, dials /p2p-circuit addresses, holds reservations."""
        return self.behaviour(RelayClient)

    @property
    def relay_service(self) -> RelayService | None:
        """Relays for others (present when ``config.relay_service`` is set)."""
        return self.behaviour(RelayService)

    @property
    def autonat(self) -> AutoNAT | None:
        """Our reachability (AutoNAT client) and dial-backs for others (service)."""
        return self.behaviour(AutoNAT)

    @property
    def holepunch(self) -> HolePuncher | None:
        """Upgrades relayed connections to direct ones (DCUtR)."""
        return self.behaviour(HolePuncher)

    # -- identity and addresses --------------------------------------------------------------
    @property
    def peer_id(self) -> ID:
        return self.host.get_id()

    @property
    def listen_addrs(self) -> list[Multiaddr]:
        """Full dialable addresses, each ending in /p2p/<our peer id>."""
        return list(self.host.get_addrs())

    def peers(self) -> list[ID]:
        """Peers with at least one open connection."""
        return list(self.host.get_connected_peers())

    def connections(self, peer: ID | str) -> list[dict]:
        """The open connections to ``peer``: whether each runs through a relay, and where to."""
        out = []
        for conn in self.host.get_network().get_connections(_as_peer_id(peer)):
            try:
                addrs = [str(a) for a in conn.get_transport_addresses()]
            except Exception:
                addrs = []
            try:
                streams = sorted(str(s.get_protocol()) for s in conn.get_streams())
            except Exception:
                streams = []
            out.append({"relayed": is_relayed(conn), "addrs": addrs, "streams": streams})
        return out

    def link(self, peer: ID | str) -> str | None:
        """How we reach ``peer`` now: "direct", "relayed" (only through relays) or None."""
        try:
            conns = self.host.get_network().get_connections(_as_peer_id(peer))
        except ShardnetError:
            return None
        if not conns:
            return None
        return "relayed" if all(is_relayed(c) for c in conns) else "direct"

    def nat_status(self) -> dict:
        """Reachability, relay slots and hole punching, for ``shardnet status`` and embedding apps:
        the NAT behaviours' snapshots (a missing behaviour reads as its empty snapshot)."""
        autonat = self.autonat.snapshot() if self.autonat is not None else AutoNATStatus()
        relay = self.relay_client.snapshot() if self.relay_client is not None else RelayClientStatus()
        punch = self.holepunch.snapshot() if self.holepunch is not None else HolePunchStatus()
        return {
            "reachability": autonat.reachability,
            "public_addrs": autonat.public_addrs,
            "checked_at": autonat.checked_at,
            "autonat_answers": autonat.answers,
            "observed_ips": autonat.observed_ips,
            "relay_slots": relay.slots,
            "circuit_addrs": relay.circuit_addrs,
            "hole_punches": punch.outcomes,
            "hole_punch_stats": punch.stats,
        }

    def status(self) -> dict[str, dict]:
        """Each behaviour's snapshot as plain data, by class name: the core ones, then those
        of the pluggable ones that have a ``snapshot()``."""
        out = {}
        for b in [*self.core_behaviours, *self._behaviours]:
            if callable(getattr(b, "snapshot", None)):
                out.setdefault(type(b).__name__, asdict(b.snapshot()))
        return out

    @property
    def discovered(self) -> dict[ID, float]:
        """Peers met through discovery, oldest first, at most discovery.MAX_DISCOVERED (value: when)."""
        return self.discovery.discovered

    @property
    def keepalive_closed(self) -> int:
        """Connections closed because their keepalive went unanswered."""
        return self.keepalive.closed

    def known_peers(self) -> list[ID]:
        """Peers we hold addresses for (connected or not), ourselves excluded."""
        me = self.peer_id
        return [p for p in self.host.get_peerstore().peers_with_addrs() if p != me]

    def addrs_of(self, peer_id: ID) -> list[Multiaddr]:
        """Known addresses of ``peer_id`` (empty once the peerstore has forgotten it)."""
        try:
            return list(self.host.get_peerstore().addrs(peer_id))
        except Exception:  # PeerStoreError: peers come and go between our look-ups
            return []

    def learn_addrs(self, peer: str, addrs, ttl: float) -> None:
        """Addresses ``peer`` signed for itself (a newer claim of its), kept ``ttl`` seconds and
        put ahead of those held for it: a peer restarted on another port is dialled where it
        listens now without waiting for a DHT lookup to say so. Ahead, not after: py-libp2p
        dials the first address it holds of each transport (``_connect_direct`` tries the others
        only once that fails)."""
        try:
            info = peer_info(peer, addrs)
        except ShardnetError:
            return
        if info.addrs:
            compat.swarm.addrs_first(self.host.get_peerstore(), info.peer_id, list(info.addrs), int(ttl))

    # -- streams -----------------------------------------------------------------------------
    def set_stream_handler(self, protocol_id: str, handler: StreamHandler) -> None:
        """Serve ``protocol_id``: ``handler`` gets a :class:`Stream`; errors it raises are
        logged and reset the stream, never the node."""

        async def _run(raw) -> None:
            stream = Stream(raw)
            self.streams_served[(protocol_id, "relayed" if stream.relayed else "direct")] += 1
            try:
                await handler(stream)
            except Exception as e:
                log.warning(
                    "handler for %s from %s failed: %s: %s",
                    protocol_id, _short(stream.remote_peer), type(e).__name__, e,
                )
                await stream.reset()
                return
            await stream.close()

        self.host.set_stream_handler(TProtocol(protocol_id), _run)

    def remove_stream_handler(self, protocol_id: str) -> None:
        self.host.remove_stream_handler(TProtocol(protocol_id))

    async def new_stream(
        self, peer: ID | str, protocol_id: str | list[str], *, timeout: float | None = None
    ) -> Stream:
        """Open a stream to ``peer`` (dialling it first if needed) for ``protocol_id``."""
        peer_id = _as_peer_id(peer)
        protocols = [protocol_id] if isinstance(protocol_id, str) else list(protocol_id)
        timeout = self.config.stream_open_timeout if timeout is None else timeout
        await self.ensure_connected(peer_id)
        with trio.move_on_after(timeout) as scope:
            try:
                raw = await self.host.new_stream(peer_id, [TProtocol(p) for p in protocols])
            except Exception as e:
                if _mentions(e, "protocol not supported", "protocols not supported"):
                    raise ProtocolNotSupported(
                        f"peer {_short(peer_id)} does not support {' or '.join(protocols)}"
                    ) from None
                limit = _cause(e, StreamLimitError)  # a limit of this node's (compat fix 17)
                if limit is not None:
                    raise StreamLimitError(str(limit)) from None
                if _cause(e, MuxedStreamReset) is not None:
                    raise self._refused_by_peer(peer_id, protocols[0]) from None
                raise DialError(f"could not open {protocols[0]} to {_short(peer_id)}: {_reason(e)}") from None
        if scope.cancelled_caught:
            raise OverlayTimeout(f"opening {protocols[0]} to {_short(peer_id)} timed out after {timeout:g} s")
        return Stream(raw)

    def _refused_by_peer(self, peer_id: ID, protocol: str) -> StreamLimitError:
        """The error for a peer resetting a new stream before any protocol was agreed: what a
        shardnet peer's stream gate does to a stream over its limits (compat fix 12)."""
        held = [compat.streams_held(c.muxed_conn) for c in self.host.get_network().get_connections(peer_id)]
        defaults = Limits()
        return StreamLimitError(
            f"peer {_short(peer_id)} refused a new {protocol} stream (reset it before any protocol was agreed), "
            f"as a shardnet peer does over its limit streams_per_peer (streams from one peer open at once, "
            f"{defaults.streams_per_peer} by default) or stream_rate_per_peer (new ones per second, "
            f"{defaults.stream_rate_per_peer:g} by default); this node holds {sum(h for h, _ in held)} streams "
            f"open to it, {sum(c for _, c in held)} of them closed by the peer and never closed here")

    # -- connections -------------------------------------------------------------------------
    async def connect(self, addr: str | Multiaddr | PeerInfo, *, timeout: float | None = None) -> ID:
        """Dial a peer address (ending in /p2p/<id>) and return its peer ID."""
        info = addr if isinstance(addr, PeerInfo) else parse_peer_addr(str(addr))
        timeout = self.config.dial_timeout if timeout is None else timeout
        if info.peer_id == self.peer_id:
            raise DialError("refusing to dial ourselves")
        direct = [a for a in info.addrs if "/p2p-circuit" not in str(a)]
        circuits = [a for a in info.addrs if "/p2p-circuit" in str(a)]
        if not circuits:
            return await self._connect_direct(PeerInfo(info.peer_id, direct), timeout)
        if direct:
            # A peer that advertises relay addresses is probably behind NAT: give its direct
            # addresses a short try (a NAT drops the SYN silently), then go through a relay.
            try:
                return await self._connect_direct(PeerInfo(info.peer_id, direct), min(timeout, DIRECT_FIRST))
            except DialError as e:
                log.debug("direct dial to %s failed (%s); trying its relays", _short(info.peer_id), e)
        return await self._connect_via_relay(info.peer_id, circuits, timeout)

    async def _connect_direct(self, info: PeerInfo, timeout: float) -> ID:
        """Dial ``info``'s peer at its addresses (put ahead of the others held for it). py-libp2p
        dials only the first held address of each transport: when that fails or takes its share
        of ``timeout`` and more are held (a restarted peer's dead port ahead of its new one), it
        goes to the back and the next is dialled, up to ``MAX_DIAL_ROUNDS`` within ``timeout``."""
        network, store = self.host.get_network(), self.host.get_peerstore()
        if info.addrs:
            compat.swarm.addrs_first(store, info.peer_id, list(info.addrs), None)
        rounds = max(1, min(MAX_DIAL_ROUNDS, len(compat.swarm.dial_places(store, info.peer_id))))
        deadline = trio.current_time() + timeout
        attempt = 1
        while True:
            # py-libp2p blocks every dial to a peer for 60 s after one failure ("negative
            # cache"); a restarted bootstrap must be reachable on our own backoff schedule
            compat.swarm.forget_failed_dial(network, info.peer_id)
            share = max(0.0, deadline - trio.current_time()) / (rounds - attempt + 1)
            with trio.move_on_after(share) as scope:
                try:
                    await self.host.connect(PeerInfo(info.peer_id, []))
                    return info.peer_id
                except Exception as e:
                    why = _reason(e)
            if scope.cancelled_caught:
                why = f"timed out after {timeout:g} s" if attempt == rounds else f"no answer within {share:.1f} s"
            if attempt == rounds:
                raise DialError(f"could not connect to {_short(info.peer_id)}: {why}")
            log.debug("dial to %s failed (%s); trying its other addresses", _short(info.peer_id), why)
            compat.swarm.dialled_addr_to_back(store, info.peer_id)
            attempt += 1

    async def _connect_via_relay(self, peer_id: ID, circuits: list[Multiaddr], timeout: float) -> ID:
        relay_client = self.relay_client
        if relay_client is None:
            raise DialError(f"could not reach {_short(peer_id)}: it is reachable only through relays, "
                            "and this node runs no relay client")
        errors = []
        for addr in circuits:
            try:
                relay, _ = parse_circuit_addr(f"{addr}/p2p/{peer_id}" if not str(addr).endswith(str(peer_id))
                                              else addr)
                await relay_client.dial(relay, peer_id, timeout=timeout)
                return peer_id
            except trio.TooSlowError:
                errors.append(f"{addr}: timed out after {timeout:g} s")
            except (ShardnetError, ValueError) as e:
                errors.append(str(e))
        raise DialError(f"could not reach {_short(peer_id)} through a relay: {'; '.join(errors)}")

    async def ensure_connected(self, peer_id: ID) -> None:
        if peer_id in self.host.get_connected_peers():
            return
        addrs = self.addrs_of(peer_id)
        if not addrs:
            info = await self.find_peer(peer_id)
            if info is None or not info.addrs:
                raise DialError(f"no known address for peer {_short(peer_id)}")
            addrs = info.addrs
        await self.connect(PeerInfo(peer_id, addrs))

    async def wait_bootstrapped(self, timeout: float | None = None, *, fail_fast: bool = True) -> ID:
        """Wait until at least one bootstrap peer is connected.

        Raises DialError naming the reasons when none is connected within ``timeout`` (default:
        the dial timeout) or, with ``fail_fast``, as soon as every bootstrap has failed a dial.
        """
        boots = [parse_peer_addr(a) for a in self.config.bootstrap]
        if not boots:
            raise DialError("no bootstrap peers configured")
        timeout = self.config.dial_timeout if timeout is None else timeout
        with trio.move_on_after(timeout):
            while True:
                changed = self._links_changed
                for info in boots:
                    if info.peer_id in self.host.get_connected_peers():
                        return info.peer_id
                if fail_fast and all(b.peer_id in self.bootstrap.errors for b in boots):
                    break
                await changed.wait()
        reasons = "; ".join(self.bootstrap.errors.get(b.peer_id, "no answer") for b in boots)
        raise DialError(f"could not reach any bootstrap peer ({reasons})")

    async def disconnect(self, peer_id: ID | str) -> None:
        with trio.move_on_after(self.config.dial_timeout):
            await self.host.disconnect(_as_peer_id(peer_id))

    async def ping(self, peer: ID | str, *, timeout: float = 10.0) -> float:
        """Round-trip time in seconds of one libp2p ping (dialling first if needed)."""
        peer_id = _as_peer_id(peer)
        stream = await self.new_stream(peer_id, PING_PROTOCOL, timeout=timeout)
        try:
            payload = secrets.token_bytes(32)
            t0 = time.perf_counter()
            await stream.write(payload, timeout=timeout)
            echo = await stream.read_exactly(32, timeout=timeout)
            rtt = time.perf_counter() - t0
        finally:
            await stream.close()
        if echo != payload:
            raise ShardnetError(f"peer {_short(peer_id)} answered ping with different bytes")
        return rtt

    async def ping_many(self, peers, *, timeout: float = 3.0, samples: int = 1) -> dict[str, PingResult]:
        """Ping every peer at once: per peer the least RTT of ``samples`` pings, or the error and
        how long it took to come (a quick failure is a peer gone, a slow one a peer far away)."""
        out: dict[str, PingResult] = {}

        async def one(peer: str) -> None:
            t0 = trio.current_time()
            try:
                rtt = min([await self.ping(peer, timeout=timeout) for _ in range(samples)])
                out[peer] = PingResult(rtt, trio.current_time() - t0, None)
            except (ShardnetError, trio.TooSlowError, OSError) as e:
                out[peer] = PingResult(None, trio.current_time() - t0, e)

        async with trio.open_nursery() as nursery:
            for p in dict.fromkeys(str(p) for p in peers):
                nursery.start_soon(one, p)
        return out

    async def find_peer(self, peer_id: ID | str) -> PeerInfo | None:
        """Ask the DHT for a peer's addresses (bounded by ``dht_timeout``)."""
        return await self.dht.find_peer(_as_peer_id(peer_id))

    # -- peer events -------------------------------------------------------------------------
    @asynccontextmanager
    async def peer_events(self, buffer: int = 1024) -> AsyncIterator[trio.MemoryReceiveChannel[PeerEvent]]:
        send, recv = trio.open_memory_channel[PeerEvent](buffer)
        self._peer_watchers.append(send)
        try:
            yield recv
        finally:
            self._peer_watchers.remove(send)
            send.close()

    @property
    def links_changed(self) -> trio.Event:
        """Set (and replaced) when a connection opens or closes or a bootstrap dial fails: read
        it, check what you wait for, then wait on it."""
        return self._links_changed

    def note_links_changed(self) -> None:
        """Set ``links_changed`` (and replace it): for the behaviours that learn of a change."""
        self._links_changed.set()
        self._links_changed = trio.Event()

    def emit(self, event: PeerEvent) -> None:
        """Tell the ``peer_events`` watchers (a connection event also sets ``links_changed``)."""
        if event.kind != "discovered":
            self.note_links_changed()
        for ch in list(self._peer_watchers):
            try:
                ch.send_nowait(event)
            except trio.WouldBlock:
                log.warning("peer-event watcher is full; dropped %s %s", event.kind, event.peer_id)


def default_behaviours(config: NodeConfig) -> list[NodeBehaviour]:
    """The behaviours ``open_node(config)`` runs when given none, as ``config`` asks: the relay
    service (when ``relay_service`` is set), AutoNAT, hole punching and the relay client.

    Their order is the order they start in: the ones that only register handlers first, so that
    peers identifying us meanwhile see every protocol; the relay client last, since it is ready
    only once it holds a slot at a configured relay (or gave up within the dial timeout)."""
    relays = [parse_peer_addr(a, what="relay address") for a in config.relays]
    checks = config.autonat and config.autonat_client
    out: list[NodeBehaviour] = []
    if config.relay_service is not None:
        out.append(RelayService(config.relay_service))
    out.append(AutoNAT(serve=config.autonat, check=checks, interval=config.autonat_interval))
    out.append(HolePuncher(punch=config.hole_punch))
    out.append(RelayClient(relays, auto_relays=config.auto_relays if checks and not relays else 0,
                           wait=config.dial_timeout))
    return out


@asynccontextmanager
async def open_node(config: NodeConfig | None = None,
                    behaviours: list[NodeBehaviour] | None = None) -> AsyncIterator[Node]:
    """Start a node; yield it; stop everything it started when the block ends.

    ``behaviours``: what the node runs besides its core (host, DHT, gossip and the core
    behaviours: bootstrap supervision, discovery, keepalive, connection manager), started in order, each ready before
    the next starts and all before the node is yielded; None runs ``default_behaviours(config)``.
    An app that adds its own passes ``[*default_behaviours(config), Mine()]`` (or calls
    ``node.add_behaviour`` later)."""
    config = config or NodeConfig()
    setup = _Setup.of(config, behaviours)  # bad input fails here, before anything starts
    # An exception from the caller's block (or from a behaviour that failed to start) is held
    # and re-raised once everything we started has stopped, so it reaches the caller as itself,
    # not wrapped in the exception groups of our internal nurseries.
    held = HeldError()
    async with AsyncExitStack() as stack:
        host = await stack.enter_async_context(_listening_host(config, setup))
        dht = await stack.enter_async_context(DHT.start(host, config))
        pubsub = await stack.enter_async_context(PubSub.start(host, config))
        node = Node(config, setup.key_pair, host, dht, pubsub, setup.bootstrap)
        host.get_network().register_notifee(_ConnectionEvents(node))
        host.set_stream_handler(TProtocol(identity_check.PROTOCOL_ID), functools.partial(identity_check.serve, node))
        nursery = await stack.enter_async_context(_node_nursery(node))
        with held:
            await _start_behaviours(node, nursery, setup.behaviours)
            if setup.checks_identity:
                await node.bootstrap.check_identity(wait=min(IDENTITY_CHECK_WAIT, config.dial_timeout))
            yield node
    held.reraise()


@dataclass(frozen=True)
class _Setup:
    """What open_node makes of its config before it starts anything."""

    key_pair: KeyPair
    listen: list[Multiaddr]
    announce: list[Multiaddr]
    bootstrap: list[PeerInfo]
    behaviours: list[NodeBehaviour]
    checks_identity: bool  # ask the bootstrap peers whether our identity is live elsewhere

    @classmethod
    def of(cls, config: NodeConfig, behaviours: list[NodeBehaviour] | None) -> _Setup:
        compat.apply()
        if config.tune_allocator:
            allocator.tune()
        key_pair = _resolve_identity(config)
        listen = [parse_multiaddr(a, what="--listen") for a in config.listen]
        announce = [parse_multiaddr(a, what="--announce") for a in config.announce]
        bootstrap = [parse_peer_addr(a, what="bootstrap address") for a in config.bootstrap]
        behaviours = default_behaviours(config) if behaviours is None else list(behaviours)
        check_listen_ports(listen)
        persistent = config.key_pair is not None or config.identity_path is not None
        return cls(key_pair, listen, announce, bootstrap, behaviours,
                   checks_identity=config.check_identity and persistent and bool(bootstrap))


@asynccontextmanager
async def _listening_host(config: NodeConfig, setup: _Setup) -> AsyncIterator:
    """The libp2p host, listening (or ShardnetError if it could not listen anywhere)."""
    compat.set_keepalive_interval(config.keepalive_interval, config.keepalive_max_interval)
    host = build_host(config, setup.key_pair, setup.announce)
    async with host.run(setup.listen):
        try:
            if not host.get_transport_addrs():
                raise ShardnetError(f"could not listen on any of {', '.join(map(str, setup.listen))}")
            compat.register_peerstore(host.get_peerstore())
            host.set_stream_handler(TProtocol(compat.LARGE_FRAMES_PROTOCOL), _refuse_stream)
            yield host
        finally:
            # py-libp2p's own stop path closes connections and listeners from inside a
            # cancelled scope, so the first await aborts it and the listening socket stays
            # open after the node is gone. Close the swarm explicitly, shielded and bounded.
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await host.get_network().close()


@asynccontextmanager
async def _node_nursery(node: Node) -> AsyncIterator[trio.Nursery]:
    """The node's own nursery, cancelled (with every behaviour in it) when the block ends."""
    try:
        async with trio.open_nursery() as nursery:
            node.nursery = nursery
            try:
                yield nursery
            finally:
                node._closing = True  # stopped behaviours stay readable (stats after the fact)
                nursery.cancel_scope.cancel()
    finally:
        node.nursery = None


async def _start_behaviours(node: Node, nursery: trio.Nursery, behaviours: list[NodeBehaviour]) -> None:
    """Bootstrap supervision first (its dials start at once), then the pluggable behaviours in
    order (``node.started`` once all are ready), then discovery, keepalive and the connection manager."""
    await nursery.start(node.bootstrap.run, node)
    for b in behaviours:
        await node.add_behaviour(b)
    node.started.set()
    await nursery.start(node.discovery.run, node)
    await nursery.start(node.keepalive.run, node)
    await nursery.start(node.connection_manager.run, node)
    log.info("node %s listening on %s", node.peer_id, ", ".join(map(str, node.listen_addrs)))


async def _refuse_stream(raw) -> None:
    """Capability markers are advertised, never spoken."""
    await raw.reset()


def _resolve_identity(config: NodeConfig) -> KeyPair:
    if config.key_pair is not None:
        return config.key_pair
    if config.identity_path is not None:
        return identity.load_or_create(config.identity_path)[0]
    return identity.generate()


def _as_peer_id(peer: ID | str) -> ID:
    if isinstance(peer, ID):
        return peer
    try:
        return ID.from_base58(peer)
    except Exception:
        raise ShardnetError(f"not a peer ID: {peer!r}") from None


def _short(peer_id: ID) -> str:
    s = str(peer_id)
    return s if len(s) <= 16 else f"{s[:6]}…{s[-6:]}"


def _mentions(e: BaseException, *needles: str) -> bool:
    """Whether any exception in ``e``'s cause chain says one of ``needles``."""
    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 20:
        text = str(cur).lower()
        if any(n in text for n in needles):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def _reason(e: BaseException) -> str:
    """The most specific cause of a dial failure, on one line (e.g. "Connection refused")."""
    refusal = admission_reason(e)
    if refusal is not None:
        return refusal
    best = _deepest_cause(e, 0)
    if isinstance(best, OSError) and best.strerror:
        return best.strerror
    text = str(best).strip().splitlines()
    return f"{type(best).__name__}: {text[0] if text else ''}".strip(": ")


def _cause(e: BaseException, kind: type[E]) -> E | None:
    """The first exception of ``kind`` in ``e``'s cause chain (``e`` included)."""
    cur: BaseException | None = e
    for _ in range(20):
        if cur is None or isinstance(cur, kind):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def _deepest_cause(e: BaseException, depth: int) -> BaseException:
    if depth > 20:
        return e
    children: list[BaseException] = []
    for attr in ("errors", "exceptions"):
        group = getattr(e, attr, None)
        if isinstance(group, (list, tuple)):
            children += [c for c in group if isinstance(c, BaseException)]
    if e.__cause__ is not None:
        children.append(e.__cause__)
    elif e.__context__ is not None and not e.__suppress_context__:
        children.append(e.__context__)
    for child in children:
        found = _deepest_cause(child, depth + 1)
        if isinstance(found, OSError):
            return found
    return _deepest_cause(children[0], depth + 1) if children else e
