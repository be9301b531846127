"""Circuit relay v2 on a shardnet node: the relay's hop service, and the client side (reserve a
slot, keep it, accept circuits through the stop protocol, dial through a relay).

A relayed connection is a hop stream at the dialer and a stop stream at the target, spliced by
the relay; both ends then run the usual security and multiplexer handshake over it, so it is a
full libp2p connection (Noise end to end: the relay sees ciphertext) registered in the swarm
like any other, and every protocol (activation streams included) runs over it unchanged.
py-libp2p 0.8.1 ships a circuit v2 module, but its listener answers the stop protocol in two
places with different replies; this one is built on the sans-IO codec in relay_messages.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import trio
from libp2p.abc import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from ..behaviour import Behaviour
from ..compat.swarm import is_relayed  # noqa: F401  (re-exported for nat/ and node.py)
from ..config import dial_place
from ..errors import ShardnetError
from .rawstream import PrefixedStream, close_quietly, read_message
from .relay_messages import (
    HOP_PROTOCOL, STOP_PROTOCOL, FrameBuffer, HopMessage, HopType, Limit, Peer, RelayProtocolError, Reservation,
    Status, StopMessage, StopType, decode_hop, decode_stop, encode_hop, encode_stop)

log = logging.getLogger(__name__)

IO_TIMEOUT = 10.0  # seconds for any one protocol exchange
COPY_CHUNK = 1 << 16


class RelayError(ShardnetError):
    """A relay refused or failed; ``status`` says why."""

    code = "relay"

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RelayLimits:
    reservation_ttl: float = 3600.0  # seconds a reservation lasts unless refreshed
    max_reservations: int = 128
    max_circuits_per_peer: int = 16  # open circuits from or to any one peer
    circuit_bytes: int = 1 << 30  # per direction, per circuit
    circuit_duration: float = 3600.0  # seconds


def circuit_addr(relay_addr: Multiaddr | None, relay: ID, target: ID | None = None) -> Multiaddr:
    """``<relay addr>/p2p/<relay>/p2p-circuit[/p2p/<target>]`` (no address part without one)."""
    base = dial_place(relay_addr) if relay_addr is not None else ""
    tail = f"/p2p/{target}" if target else ""
    return Multiaddr(f"{base}/p2p/{relay}/p2p-circuit{tail}")


def parse_circuit_addr(addr: str | Multiaddr) -> tuple[PeerInfo, ID]:
    """(the relay, with its address; the target) from ``.../p2p/<relay>/p2p-circuit/p2p/<target>``."""
    text = str(addr)
    if "/p2p-circuit" not in text:
        raise ValueError(f"{text} is not a relay circuit address")
    relay_part, _, target_part = text.partition("/p2p-circuit")
    if not target_part.startswith("/p2p/") or "/p2p/" not in relay_part:
        raise ValueError(f"{text}: need <relay addr>/p2p/<relay id>/p2p-circuit/p2p/<target id>")
    relay_id = ID.from_base58(relay_part.rsplit("/p2p/", 1)[1])
    relay_addr = relay_part.rsplit("/p2p/", 1)[0]
    return PeerInfo(relay_id, [Multiaddr(relay_addr)] if relay_addr else []), ID.from_base58(target_part[5:])


# -- stream helpers ------------------------------------------------------------------------------

async def _exchange(raw, frame: bytes | None, fb: FrameBuffer, decode, timeout: float = IO_TIMEOUT):
    with trio.fail_after(timeout):
        if frame is not None:
            await raw.write(frame)
        return await read_message(raw, fb, decode, chunk=COPY_CHUNK)


class _CircuitStream(PrefixedStream):
    """A relay stream as a byte pipe for a raw connection: bytes read past the last protocol
    message come out first."""

    async def close(self) -> None:
        await self.stream.reset()

    def get_remote_address(self):
        return None


def _raw_connection(raw, leftover: bytes, initiator: bool, addr: Multiaddr) -> RawConnection:
    return RawConnection(_CircuitStream(raw, leftover), initiator, ConnectionType.RELAYED, [addr])


def _guarded(handler):
    """A stream handler that never lets an error reach the swarm: log it, reset the stream."""
    async def run(raw) -> None:
        try:
            await handler(raw)
        except Exception as e:
            log.info("%s: %s: %s", handler.__name__, type(e).__name__, e)
            with trio.move_on_after(1):
                try:
                    await raw.reset()
                except Exception:
                    pass

    return run


# -- the relay -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RelayServiceStatus:
    """What the relay service holds (``RelayService.snapshot``), as plain data."""

    reservations: dict[str, float] = field(default_factory=dict)  # peer -> expiry (Unix time)
    circuits: int = 0  # open now
    stats: dict[str, int] = field(default_factory=dict)


class RelayService(Behaviour):
    """A node behaviour: serves the hop protocol, reservations and circuits, within ``limits``."""

    def __init__(self, limits: RelayLimits | None = None) -> None:
        self.limits = limits or RelayLimits()
        self.reservations: dict[ID, float] = {}  # peer -> expiry (Unix time)
        self.circuits: Counter[ID] = Counter()
        self.stats = Counter()

    def attach(self, node) -> None:
        self.node = node
        node.host.set_stream_handler(TProtocol(HOP_PROTOCOL), _guarded(self._handle_hop))

    def snapshot(self) -> RelayServiceStatus:
        return RelayServiceStatus({str(p): t for p, t in self.reservations.items()},
                                  sum(self.circuits.values()) // 2, dict(self.stats))  # counted at both ends

    def _limit(self) -> Limit:
        return Limit(duration=int(self.limits.circuit_duration), data=self.limits.circuit_bytes)

    async def _handle_hop(self, raw) -> None:
        peer = raw.muxed_conn.peer_id
        fb = FrameBuffer()
        try:
            msg = await _exchange(raw, None, fb, decode_hop)
        except Exception as e:  # malformed, too slow, or the stream broke
            log.info("hop from %s: %s", str(peer)[:16], e)
            await _reply(raw, HopMessage(HopType.STATUS, status=Status.MALFORMED_MESSAGE))
            return
        if msg.type == HopType.RESERVE:
            await self._reserve(raw, peer)
        elif msg.type == HopType.CONNECT and msg.peer is not None:
            await self._connect(raw, peer, msg, fb)
        else:
            await _reply(raw, HopMessage(HopType.STATUS, status=Status.UNEXPECTED_MESSAGE))

    async def _reserve(self, raw, peer: ID) -> None:
        now = time.time()
        self.reservations = {p: t for p, t in self.reservations.items() if t > now}
        if is_relayed(raw.muxed_conn) or (peer not in self.reservations
                                          and len(self.reservations) >= self.limits.max_reservations):
            self.stats["reservations_refused"] += 1
            await _reply(raw, HopMessage(HopType.STATUS, status=Status.RESERVATION_REFUSED))
            return
        expire = int(now + self.limits.reservation_ttl)
        self.reservations[peer] = expire
        self.stats["reservations"] += 1
        # our addresses for the client to advertise: not loopback ones, unless that is all we have
        mine = [a for a in self.node.listen_addrs if "/p2p-circuit" not in str(a)]
        routable = [a for a in mine if not str(a).startswith(("/ip4/127.", "/ip6/::1/"))]
        addrs = [a.to_bytes() for a in routable or mine]
        log.info("reservation for %s until %s", str(peer)[:16], time.strftime("%H:%M:%S", time.localtime(expire)))
        await _reply(raw, HopMessage(HopType.STATUS, reservation=Reservation(expire, addrs), limit=self._limit(),
                                     status=Status.OK), close=True)

    async def _connect(self, src_raw, src: ID, msg: HopMessage, src_fb: FrameBuffer) -> None:
        try:
            target = ID(msg.peer.id)
        except Exception:
            await _reply(src_raw, HopMessage(HopType.STATUS, status=Status.MALFORMED_MESSAGE))
            return
        if self.reservations.get(target, 0) <= time.time():
            await _reply(src_raw, HopMessage(HopType.STATUS, status=Status.NO_RESERVATION))
            return
        cap = self.limits.max_circuits_per_peer
        if self.circuits[src] >= cap or self.circuits[target] >= cap:
            await _reply(src_raw, HopMessage(HopType.STATUS, status=Status.RESOURCE_LIMIT_EXCEEDED))
            return
        if target not in self.node.host.get_connected_peers():  # no active relaying: only reserved peers
            await _reply(src_raw, HopMessage(HopType.STATUS, status=Status.CONNECTION_FAILED))
            return
        self.circuits[src] += 1
        self.circuits[target] += 1
        dst_raw = None
        cut = "not spliced"
        try:
            dst_fb = FrameBuffer()
            try:
                with trio.fail_after(IO_TIMEOUT):
                    dst_raw = await self.node.host.new_stream(target, [TProtocol(STOP_PROTOCOL)])
                reply = await _exchange(dst_raw, encode_stop(StopMessage(
                    StopType.CONNECT, peer=Peer(src.to_bytes()), limit=self._limit())), dst_fb, decode_stop)
                if reply.type != StopType.STATUS or reply.status != Status.OK:
                    raise RelayError(reply.status, f"target answered {reply.status}")
            except Exception as e:
                log.info("circuit %s -> %s failed at the target: %s", str(src)[:16], str(target)[:16], e)
                self.stats["circuits_failed"] += 1
                await _reply(src_raw, HopMessage(HopType.STATUS, status=Status.CONNECTION_FAILED))
                return
            await src_raw.write(encode_hop(HopMessage(HopType.STATUS, limit=self._limit(), status=Status.OK)))
            self.stats["circuits"] += 1
            log.info("circuit %s -> %s open", str(src)[:16], str(target)[:16])
            cut, forward, backward = await self._splice(src_raw, src_fb.take_rest(), dst_raw, dst_fb.take_rest())
            log.info("circuit %s -> %s %s (%d bytes forward, %d back)", str(src)[:16], str(target)[:16],
                     f"cut: {cut}" if cut else "closed by both ends", forward, backward)
        finally:
            self.circuits[src] -= 1
            self.circuits[target] -= 1
            for s in (src_raw, dst_raw):
                if s is not None:
                    # A reset unless both ends closed their halves: an end must never take a cut
                    # circuit for one that finished.
                    with trio.CancelScope(shield=True), trio.move_on_after(1):
                        try:
                            await (s.close() if cut == "" else s.reset())
                        except Exception:
                            pass

    async def _splice(self, a, a_rest: bytes, b, b_rest: bytes) -> tuple[str, int, int]:
        """Copy both ways. An end that closes its half has that half closed at the other end
        too, and the other direction goes on; a direction over its byte limit, the duration or
        an error cuts both. Returns (why it was cut, or "" if both ends closed; bytes forward;
        bytes back)."""
        limit = self.limits.circuit_bytes
        sent = {"forward": 0, "back": 0}
        cut = ""

        async def copy(src, rest: bytes, dst, direction: str, scope: trio.CancelScope) -> None:
            nonlocal cut
            try:
                if rest:
                    await dst.write(rest)
                    sent[direction] += len(rest)
                while sent[direction] < limit:
                    try:
                        data = await src.read(min(COPY_CHUNK, limit - sent[direction]))
                    except EOFError:  # py-libp2p's streams end with an exception, not b""
                        data = b""
                    if not data:
                        closing = getattr(getattr(src, "muxed_conn", None), "event_shutting_down", None)
                        if closing is not None and closing.is_set():
                            # our own connection to that end is closing (keepalive, pruning):
                            # an end of its stream here is no FIN of that peer's
                            raise EOFError("the relay's connection to it closed")
                        await dst.close_write()  # this half is done; the other may still be talking
                        return
                    await dst.write(data)
                    sent[direction] += len(data)
                    self.stats["bytes_relayed"] += len(data)
                self.stats["circuits_over_data_limit"] += 1
                cut = cut or f"{direction} data limit of {limit} bytes"
            except Exception as e:
                cut = cut or f"{direction}: {type(e).__name__}: {e}".rstrip(": ")
            scope.cancel()

        with trio.move_on_after(self.limits.circuit_duration) as timer:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(copy, a, a_rest, b, "forward", nursery.cancel_scope)
                nursery.start_soon(copy, b, b_rest, a, "back", nursery.cancel_scope)
        if timer.cancelled_caught:
            cut = cut or f"duration limit of {self.limits.circuit_duration:g} s"
        return cut, sent["forward"], sent["back"]


async def _reply(raw, msg: HopMessage, close: bool = False) -> None:
    try:
        with trio.fail_after(IO_TIMEOUT):
            await raw.write(encode_hop(msg))
            if close or msg.status != Status.OK:
                await raw.close()
    except Exception as e:
        log.debug("could not send %s: %s", msg.status, e)


# -- the client side -----------------------------------------------------------------------------

@dataclass(frozen=True)
class RelayClientStatus:
    """The relay client's slots (``RelayClient.snapshot``), as plain data."""

    slots: dict[str, float] = field(default_factory=dict)  # relay -> when our reservation expires (Unix time)
    circuit_addrs: list[str] = field(default_factory=list)  # where others can reach us through relays


class RelayClient(Behaviour):
    """A node behaviour: accepts circuits (stop protocol), reserves slots and dials through relays.

    It holds a slot at each of ``relays`` for as long as it runs, and is ready once it has a first
    one (or after ``wait`` seconds without: it then keeps trying in the background). With
    ``auto_relays``, while AutoNAT says we are private it also holds slots at up to that many
    relays found among our peers."""

    def __init__(self, relays: list[PeerInfo] | tuple = (), *, auto_relays: int = 0, wait: float = 20.0) -> None:
        self.relays = list(relays)
        self.auto_relays = auto_relays
        self.wait = wait
        self.reservations: dict[ID, Reservation] = {}
        self.circuit_addrs: list[Multiaddr] = []  # where others can reach us through relays
        self.changed = trio.Event()  # set (and replaced) whenever circuit_addrs changes

    def attach(self, node) -> None:
        self.node = node
        node.host.set_stream_handler(TProtocol(STOP_PROTOCOL), _guarded(self._handle_stop))
        host = node.host
        plain = host.get_addrs
        me = node.peer_id

        def with_circuits() -> list[Multiaddr]:
            return list(plain()) + [Multiaddr(f"{a}/p2p/{me}") for a in self.circuit_addrs]

        host.get_addrs = with_circuits  # identify and the DHT advertise what get_addrs returns

    def snapshot(self) -> RelayClientStatus:
        return RelayClientStatus({str(p): r.expire for p, r in self.reservations.items()},
                                 [str(a) for a in self.circuit_addrs])

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        for info in self.relays:
            self.spawn(self.keep_reservation, info)
        if self.relays:
            # reachable through a relay before anything (a claim) advertises our addresses
            with trio.move_on_after(self.wait):
                while not self.circuit_addrs:
                    await self.changed.wait()
            if not self.circuit_addrs:
                log.warning("no relay slot yet; peers behind other NATs cannot reach us")
        task_status.started()
        if self.auto_relays > 0:
            await self._find_relays()
        await trio.sleep_forever()

    async def _find_relays(self) -> None:
        """While AutoNAT says we are private, hold slots at up to ``auto_relays`` relays found
        among our peers (their identify lists the hop protocol); give them up once public."""
        from .autonat import PRIVATE, PUBLIC  # here: autonat imports this module

        autonat = self.node.autonat
        if autonat is None:
            log.info("no AutoNAT on this node: not looking for relays")
            return
        held: dict[ID, trio.CancelScope] = {}

        async def hold(relay: ID, scope: trio.CancelScope) -> None:
            with scope:
                await self.keep_reservation(PeerInfo(relay, self.node.addrs_of(relay)), give_up_after=3)
            held.pop(relay, None)
            self.drop(relay)

        while True:
            status = autonat.status
            if status == PRIVATE and len(held) < self.auto_relays:
                for relay in self._relay_candidates():
                    if relay in held or len(held) >= self.auto_relays:
                        continue
                    log.info("behind NAT: holding a slot at relay %s", str(relay)[:16])
                    held[relay] = trio.CancelScope()
                    self.spawn(hold, relay, held[relay])
            elif status == PUBLIC and held:
                log.info("publicly reachable: giving up %d relay slot(s)", len(held))
                for scope in held.values():
                    scope.cancel()
            with trio.move_on_after(5.0):
                await autonat.changed.wait()

    def _relay_candidates(self) -> list[ID]:
        host = self.node.host
        store = host.get_peerstore()
        out = []
        for peer in host.get_connected_peers():
            try:
                if HOP_PROTOCOL in store.get_protocols(peer):
                    out.append(peer)
            except Exception:
                continue
        return out

    async def reserve(self, relay: PeerInfo) -> Reservation:
        """Ask ``relay`` for a slot; returns the reservation (raises RelayError if refused)."""
        await self.node.connect(relay)
        try:
            raw = await self.node.host.new_stream(relay.peer_id, [TProtocol(HOP_PROTOCOL)])
        except Exception as e:
            raise RelayError(None, f"{str(relay.peer_id)[:16]}… is not a relay: {e}") from None
        try:
            reply = await _exchange(raw, encode_hop(HopMessage(HopType.RESERVE)), FrameBuffer(), decode_hop)
        except (RelayProtocolError, trio.TooSlowError) as e:
            raise RelayError(None, f"reservation at {str(relay.peer_id)[:16]}… failed: {e or 'timeout'}") from None
        finally:
            await close_quietly(raw)
        if reply.type != HopType.STATUS or reply.status != Status.OK or reply.reservation is None:
            raise RelayError(reply.status, f"relay {str(relay.peer_id)[:16]}… refused the reservation "
                                           f"({_status_name(reply.status)})")
        self.reservations[relay.peer_id] = reply.reservation
        addrs = []
        for b in reply.reservation.addrs:
            try:
                addrs.append(Multiaddr(b))
            except Exception:
                continue
        relay_addrs = addrs or list(relay.addrs)
        fresh = [circuit_addr(a, relay.peer_id) for a in relay_addrs if "/p2p-circuit" not in str(a)]
        kept = [a for a in self.circuit_addrs if f"/p2p/{relay.peer_id}/" not in str(a)]
        self._set_circuits(kept + fresh)
        return reply.reservation

    def _forget_circuits(self, relay: ID) -> None:
        self._set_circuits([a for a in self.circuit_addrs if f"/p2p/{relay}/" not in str(a)])

    def _set_circuits(self, addrs: list[Multiaddr]) -> None:
        if [str(a) for a in addrs] != [str(a) for a in self.circuit_addrs]:
            self.circuit_addrs = addrs
            self.changed.set()  # whoever advertises our addresses (claims) does so again now
            self.changed = trio.Event()

    def drop(self, relay: ID) -> None:
        """Stop advertising ``relay``'s circuits (the slot there lapses)."""
        self.reservations.pop(relay, None)
        self._forget_circuits(relay)

    async def keep_reservation(self, relay: PeerInfo, *, give_up_after: int | None = None) -> None:
        """Hold a slot at ``relay`` for as long as this runs: refresh it before it expires, and
        reconnect and reserve again (backing off up to 30 s) when the relay goes away; with
        ``give_up_after``, return after that many failures in a row."""
        backoff = 1.0
        failures = 0
        while True:
            try:
                rsvp = await self.reserve(relay)
                backoff = 1.0
                failures = 0
                ttl = max(5.0, (rsvp.expire or time.time() + 60) - time.time())
                log.info("relay slot at %s for %.0f s", str(relay.peer_id)[:16], ttl)
                # refresh at three quarters of the lifetime, or at once if the relay drops us
                with trio.move_on_after(ttl * 0.75):
                    while True:
                        changed = self.node.links_changed
                        if relay.peer_id not in self.node.host.get_connected_peers():
                            break
                        await changed.wait()
                    log.info("lost the relay %s; reserving again", str(relay.peer_id)[:16])
            except Exception as e:  # whatever broke (refusal, dial, a stream reset), try again later
                self._forget_circuits(relay.peer_id)
                failures += 1
                if give_up_after is not None and failures >= give_up_after:
                    log.info("relay %s: %s; giving it up", str(relay.peer_id)[:16], e)
                    return
                log.info("relay %s: %s; retrying in %.0f s", str(relay.peer_id)[:16], e, backoff)
                await trio.sleep(backoff)
                backoff = min(30.0, backoff * 2)

    async def dial(self, relay: PeerInfo, target: ID, *, timeout: float = 20.0) -> None:
        """Connect to ``target`` through ``relay`` (which must hold a reservation for it)."""
        await self.node.connect(relay)
        with trio.fail_after(timeout):
            raw = await self.node.host.new_stream(relay.peer_id, [TProtocol(HOP_PROTOCOL)])
            fb = FrameBuffer()
            try:
                reply = await _exchange(raw, encode_hop(HopMessage(HopType.CONNECT, peer=Peer(target.to_bytes()))),
                                        fb, decode_hop)
            except RelayProtocolError as e:
                await raw.reset()
                raise RelayError(None, f"relay {str(relay.peer_id)[:16]}…: {e}") from None
            if reply.type != HopType.STATUS or reply.status != Status.OK:
                await raw.reset()
                raise RelayError(reply.status, f"relay {str(relay.peer_id)[:16]}… could not connect us to "
                                               f"{str(target)[:16]}… ({_status_name(reply.status)})")
            addr = circuit_addr(relay.addrs[0] if relay.addrs else None, relay.peer_id, target)
            await self.node.host.get_network().upgrade_outbound_raw_conn(
                _raw_connection(raw, fb.take_rest(), True, addr), target)

    async def _handle_stop(self, raw) -> None:
        relay = raw.muxed_conn.peer_id
        fb = FrameBuffer()
        try:
            msg = await _exchange(raw, None, fb, decode_stop)
            if msg.type != StopType.CONNECT or msg.peer is None:
                raise RelayProtocolError("expected CONNECT with a peer")
            src = ID(msg.peer.id)
        except Exception as e:
            log.info("stop from %s: %s", str(relay)[:16], e)
            with trio.move_on_after(IO_TIMEOUT):
                try:
                    await raw.write(encode_stop(StopMessage(StopType.STATUS, status=Status.MALFORMED_MESSAGE)))
                    await raw.reset()
                except Exception:
                    pass
            return
        await raw.write(encode_stop(StopMessage(StopType.STATUS, status=Status.OK)))
        addr = circuit_addr(None, relay, src)
        log.info("circuit from %s via %s", str(src)[:16], str(relay)[:16])
        try:
            await self.node.host.get_network().upgrade_inbound_raw_conn(
                _raw_connection(raw, fb.take_rest(), False, addr), addr)
        except Exception as e:
            log.info("circuit from %s failed its handshake: %s", str(src)[:16], e)
            return
        puncher = self.node.holepunch
        if puncher is not None and puncher.punches:
            # DCUtR: the side that accepted the relayed connection starts the upgrade
            puncher.start(src)


def _status_name(status: int | None) -> str:
    try:
        return Status(status).name
    except ValueError:
        return f"status {status}"
