"""DCUtR: turn a relayed connection into a direct one by a coordinated simultaneous dial.

The peer that *accepted* a relayed connection (B) starts: over the relayed connection it sends
CONNECT with the addresses others see it at, A answers CONNECT with its own, B measures that
round trip, sends SYNC and, half a round trip later (when SYNC reaches A), both dial each other
at once. Each dials from its TCP listen port, the port its address guesses name, so each side's
outgoing SYN opens the NAT mapping that the other side's SYN then arrives on: TCP simultaneous
open. With endpoint-independent NATs this yields one TCP connection; a NAT that picks a fresh
port per destination (symmetric) maps the SYN elsewhere and the attempt times out.

Roles: in the security handshake A is the client and B the server (as the spec says), whichever
SYN got there first.

Both sides may have accepted a relayed connection from the other (each dialed the other through
the relay at about the same moment) and so both start. Two upgrades at once fail every attempt:
each side dials from its one listen port to the same address twice, in opposite roles. So only
one goes on (the "glare" rule of call setup): a peer that receives CONNECT while its own upgrade
to that peer has not yet been answered refuses it when its peer ID sorts first, and otherwise
drops its own and answers. Both sides apply the rule and arrive at the same single upgrade.

The direct connection joins the swarm next to the relayed one; new streams prefer it, and the
relayed one is closed when its last stream ends. Failure is recorded and
logged, never hidden: traffic stays on the relay.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import trio
from libp2p.abc import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from ..behaviour import Behaviour
from ..limits import Refusals
from .autonat import _ip_of, _tcp_port, dialable_tcp
from .holepunch_messages import DCUTR_PROTOCOL, HolePunch, HolePunchType, decode_holepunch, encode_holepunch
from .pbwire import FrameBuffer, MessageError
from .rawstream import close_quietly, read_message
from ..compat.swarm import is_relayed

log = logging.getLogger(__name__)
#: bad requests are logged at most once per peer and kind per 10 s
_refused = Refusals(log, logging.INFO)

IO_TIMEOUT = 10.0  # seconds for one message exchange over the relay
ATTEMPTS = 3  # the spec's retry count
PUNCH_TIMEOUT = 5.0  # seconds one simultaneous dial may take, handshakes included
#: seconds before retrying after a CONNECT that went unanswered (time for the peer's own to arrive)
REFUSED_PAUSE = 2.0
RETIRE_AFTER = 600.0  # seconds a relayed connection may keep streams once a direct one exists


@dataclass
class _Upgrade:
    """One upgrade we started: its cancel scope, and whether the peer answered its CONNECT."""

    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    answered: bool = False  # the attempt under way had its CONNECT answered
    answers: int = 0  # attempts whose CONNECT was answered


@dataclass
class PunchOutcome:
    peer: str
    ok: bool
    attempts: int
    seconds: float
    detail: str  # the direct address, or why it failed
    at: float  # Unix time


@dataclass(frozen=True)
class HolePunchStatus:
    """What hole punching did (``HolePuncher.snapshot``), as plain data."""

    outcomes: dict[str, dict] = field(default_factory=dict)  # peer -> its last PunchOutcome's fields
    stats: dict[str, int] = field(default_factory=dict)


class HolePuncher(Behaviour):
    """A node behaviour: both sides of DCUtR. It always answers; with ``punch`` it also starts
    an upgrade when a peer reaches us through a relay. Ready at once."""

    def __init__(self, *, punch: bool = True, attempts: int = ATTEMPTS, punch_timeout: float = PUNCH_TIMEOUT) -> None:
        self.punches = punch
        self.attempts, self.punch_timeout = attempts, punch_timeout
        self.outcomes: dict[ID, PunchOutcome] = {}  # the last outcome per peer
        self.stats = Counter()
        self._running: dict[ID, _Upgrade] = {}  # the upgrades we started, per peer
        self._answering: set[ID] = set()  # peers whose upgrade we answer now

    def attach(self, node) -> None:
        self.node = node
        node.host.set_stream_handler(TProtocol(DCUTR_PROTOCOL), self._handle)

    def snapshot(self) -> HolePunchStatus:
        return HolePunchStatus({str(p): dict(vars(o)) for p, o in self.outcomes.items()}, dict(self.stats))

    # -- helpers -----------------------------------------------------------------------------------
    def direct(self, peer: ID):
        """An open direct connection to ``peer``, or None."""
        for conn in self.node.host.get_network().get_connections(peer):
            if not is_relayed(conn) and not getattr(conn, "is_closed", False):
                return conn
        return None

    def _our_addrs(self) -> list[bytes]:
        autonat = self.node.autonat
        return [a.to_bytes() for a in autonat.candidate_addrs()] if autonat is not None else []

    def _record(self, peer: ID, ok: bool, attempts: int, t0: float, detail: str) -> PunchOutcome:
        out = PunchOutcome(str(peer), ok, attempts, time.monotonic() - t0, detail, time.time())
        self.outcomes[peer] = out
        self.stats["succeeded" if ok else "failed"] += 1
        if ok:
            log.info("hole punch to %s: direct connection after %d attempt(s), %.2f s (%s)",
                     str(peer)[:16], attempts, out.seconds, detail)
        else:
            log.warning("hole punch to %s failed after %d attempt(s), %.1f s: %s; traffic stays on the relay",
                        str(peer)[:16], attempts, out.seconds, detail)
        return out

    # -- B: the side that accepted the relayed connection starts -----------------------------------
    def start(self, peer: ID) -> None:
        """Punch to ``peer`` in the background (once at a time per peer, and not while we
        answer its own upgrade)."""
        if peer in self._running or peer in self._answering or self.direct(peer) is not None:
            return
        upgrade = self._running[peer] = _Upgrade()
        self.spawn(self._punch_in_background, peer, upgrade)

    async def _punch_in_background(self, peer: ID, upgrade: _Upgrade) -> None:
        try:
            with upgrade.scope:
                await self.punch(peer, upgrade)
        except Exception as e:
            log.warning("hole punch to %s stopped: %s: %s", str(peer)[:16], type(e).__name__, e)
        finally:
            if self._running.get(peer) is upgrade:
                del self._running[peer]
        if upgrade.scope.cancelled_caught:
            log.info("hole punch to %s: both sides started one; answering theirs", str(peer)[:16])

    def _glare(self, peer: ID) -> bool:
        """CONNECT arrived from ``peer``: whether to refuse it because our own upgrade to it goes
        on. Ours goes on when its CONNECT was answered already or when our peer ID sorts first;
        otherwise it is dropped here, and we answer theirs."""
        ours = self._running.get(peer)
        if ours is None:
            return False
        if ours.answered or self.node.host.get_id().to_bytes() < peer.to_bytes():
            return True
        ours.scope.cancel()
        return False

    async def punch(self, peer: ID, upgrade: _Upgrade | None = None) -> PunchOutcome:
        """Up to ``attempts`` coordinated dials over the relayed connection to ``peer``."""
        upgrade = upgrade or _Upgrade()
        t0 = time.monotonic()
        if not self._our_addrs():
            return self._record(peer, False, 0, t0, "we have no address to offer (loopback listeners only)")
        errors = []
        attempt = 0
        for attempt in range(1, self.attempts + 1):
            if self.direct(peer) is not None:
                return self._record(peer, True, attempt - 1, t0, "already direct")
            self.stats["attempts"] += 1
            answers = upgrade.answers
            try:
                conn = await self._initiate(peer, upgrade)
            except (MessageError, trio.TooSlowError, OSError) as e:
                errors.append(f"attempt {attempt}: {type(e).__name__}: {e}".rstrip(": "))
                if upgrade.answers == answers and attempt < self.attempts:
                    # refused unanswered: the peer may be starting its own upgrade, whose CONNECT
                    # (arriving meanwhile) ends this one
                    await trio.sleep(REFUSED_PAUSE)
                continue
            except Exception as e:  # the relayed connection or its stream broke
                errors.append(f"attempt {attempt}: {type(e).__name__}: {e}".rstrip(": "))
                if not self.node.host.get_network().get_connections(peer):
                    break
                continue
            if conn is not None:
                self._retire_relayed_later(peer)
                return self._record(peer, True, attempt, t0, _addr_text(conn))
            errors.append(f"attempt {attempt}: no direct connection within {self.punch_timeout:g} s")
        return self._record(peer, False, attempt, t0, "; ".join(errors) or "no attempt")

    async def _initiate(self, peer: ID, upgrade: _Upgrade):
        with trio.fail_after(IO_TIMEOUT):
            raw = await self.node.host.new_stream(peer, [TProtocol(DCUTR_PROTOCOL)])
        try:
            fb = FrameBuffer()
            with trio.fail_after(IO_TIMEOUT):
                sent = trio.current_time()
                await raw.write(encode_holepunch(HolePunch(HolePunchType.CONNECT, self._our_addrs())))
                reply = await read_message(raw, fb, decode_holepunch)
                rtt = trio.current_time() - sent
            if reply.type != HolePunchType.CONNECT:
                raise MessageError(f"expected CONNECT, got {reply.type.name}")
            upgrade.answered = True
            upgrade.answers += 1
            theirs = _addresses(reply.addrs)
            if not theirs:
                raise MessageError(f"the peer sent no address to dial ({_describe(reply.addrs)})")
            with trio.fail_after(IO_TIMEOUT):
                await raw.write(encode_holepunch(HolePunch(HolePunchType.SYNC)))
            await trio.sleep(rtt / 2)
            return await self._simultaneous_dial(peer, theirs, client=False)
        finally:
            upgrade.answered = False
            await close_quietly(raw)

    # -- A: the side that dialed through the relay answers -----------------------------------------
    async def _handle(self, raw) -> None:
        peer = raw.muxed_conn.peer_id
        t0 = time.monotonic()
        answering = False
        try:
            fb = FrameBuffer()
            with trio.fail_after(IO_TIMEOUT):
                msg = await read_message(raw, fb, decode_holepunch)
                if msg.type != HolePunchType.CONNECT:
                    raise MessageError(f"expected CONNECT, got {msg.type.name}")
                if self._glare(peer) or peer in self._answering:
                    self.stats["refused_while_punching"] += 1
                    log.debug("hole punch from %s refused: one with it is under way", str(peer)[:16])
                    return
                answering = True
                self._answering.add(peer)
                theirs = _addresses(msg.addrs)
                await raw.write(encode_holepunch(HolePunch(HolePunchType.CONNECT, self._our_addrs())))
                sync = await read_message(raw, fb, decode_holepunch)
                if sync.type != HolePunchType.SYNC:
                    raise MessageError(f"expected SYNC, got {sync.type.name}")
            if not theirs:
                raise MessageError(f"the peer sent no address to dial ({_describe(msg.addrs)})")
            conn = await self._simultaneous_dial(peer, theirs, client=True)
            if conn is not None:
                self._record(peer, True, 1, t0, _addr_text(conn))
                self._retire_relayed_later(peer)
            else:
                self.stats["answered_without_connection"] += 1
                log.info("hole punch from %s: no direct connection within %g s", str(peer)[:16], self.punch_timeout)
        except Exception as e:
            _refused.note(type(e).__name__, peer, f"hole punch from {str(peer)[:16]}: {type(e).__name__}: {e}")
        finally:
            if answering:
                self._answering.discard(peer)
            await close_quietly(raw)

    # -- the simultaneous dial ---------------------------------------------------------------------
    async def _simultaneous_dial(self, peer: ID, addrs: list[Multiaddr], *, client: bool):
        """Dial every address from our listen port and wait for a direct connection to ``peer``
        (ours, or the other side's if its SYN reached our listener first)."""
        port = self._listen_port()
        if port is None:
            raise MessageError("no TCP listener to punch from")
        with trio.move_on_after(self.punch_timeout):
            async with trio.open_nursery() as nursery:
                for addr in addrs:
                    nursery.start_soon(self._dial_one, peer, addr, port, client)
                while self.direct(peer) is None:
                    await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
        return self.direct(peer)

    def _listen_port(self) -> int | None:
        for a in self.node.host.get_transport_addrs():
            port = _tcp_port(a)
            if port and "/ip4/" in str(a):
                return port
        return None

    async def _dial_one(self, peer: ID, addr: Multiaddr, port: int, client: bool) -> None:
        ip, their_port = _ip_of(addr), _tcp_port(addr)
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = trio.socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            await sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
            await sock.connect((ip, their_port))
        except OSError as e:
            sock.close()
            log.debug("punch dial %s: %s", addr, e.strerror or e)
            return
        except BaseException:
            sock.close()
            raise
        raw = RawConnection(TrioTCPStream(trio.SocketStream(sock)), client, ConnectionType.DIRECT, [addr])
        swarm = self.node.host.get_network()
        try:
            if client:
                await swarm.upgrade_outbound_raw_conn(raw, peer)
            else:
                muxed = await swarm.upgrade_inbound_raw_conn(raw, addr)
                if muxed.peer_id != peer:
                    log.warning("punch dial to %s answered by %s; closing", addr, muxed.peer_id)
                    await muxed.close()
        except Exception as e:
            log.debug("punched connection to %s failed its handshake: %s", addr, e)
            await close_quietly(raw)

    # -- retiring the relayed connection ----------------------------------------------------------
    def _retire_relayed_later(self, peer: ID) -> None:
        self.spawn(self._retire_relayed, peer)

    async def _retire_relayed(self, peer: ID) -> None:
        """Close relayed connections to ``peer`` once their streams have ended (new streams go
        over the direct connection meanwhile; gossip reopens its stream there), or after
        RETIRE_AFTER seconds regardless."""
        with trio.move_on_after(RETIRE_AFTER):
            while True:
                relayed = [c for c in self.node.host.get_network().get_connections(peer) if is_relayed(c)]
                if not relayed or self.direct(peer) is None:
                    return
                idle = [c for c in relayed if not _busy(c)]
                for conn in idle:
                    log.info("closing the relayed connection to %s (direct now)", str(peer)[:16])
                    with trio.move_on_after(2):
                        await conn.close()
                if len(idle) == len(relayed):
                    return
                await trio.sleep(0.5)
        for conn in [c for c in self.node.host.get_network().get_connections(peer) if is_relayed(c)]:
            with trio.move_on_after(2):
                await conn.close()


#: Long-lived streams that their owner reopens on the remaining connection when this one closes
#: (py-libp2p's pubsub does): they do not keep a relayed connection alive.
REOPENED_PROTOCOLS = ("/meshsub/", "/floodsub/")


def _busy(conn) -> bool:
    """Whether ``conn`` carries a stream that closing it would break."""
    try:
        return any(not str(s.get_protocol()).startswith(REOPENED_PROTOCOLS) for s in conn.get_streams())
    except Exception:
        return True


def _addresses(raw_addrs: list[bytes]) -> list[Multiaddr]:
    out = []
    for b in raw_addrs[:16]:
        try:
            out.append(Multiaddr(b))
        except Exception:
            continue
    return dialable_tcp(out)


def _describe(raw_addrs: list[bytes]) -> str:
    """What a peer offered, for the log: each address as text, or its bytes when unreadable."""
    if not raw_addrs:
        return "none offered"
    out = []
    for b in raw_addrs[:16]:
        try:
            out.append(str(Multiaddr(b)))
        except Exception:
            out.append(f"unreadable {bytes(b[:32]).hex()}")
    return "offered: " + ", ".join(out)


def _addr_text(conn) -> str:
    try:
        return ", ".join(str(a) for a in conn.get_transport_addresses()) or "direct"
    except Exception:
        return "direct"
