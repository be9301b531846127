"""AutoNAT v1: is this node reachable from the internet, and at which addresses?

Every node serves ``/libp2p/autonat/1.0.0``: asked to, it dials the asker back and says whether
that worked. It dials only the IP address it sees the request come from (with the ports the asker
names), so it cannot be used to make a node dial third parties, and it dials from an ephemeral
port under a throwaway identity: a fresh connection, through the asker's NAT like a stranger's,
that does not replace or collide with the connection the request came on.

The client side asks a few connected peers, keeps the answer (``public``, ``private`` or
``unknown``) and the addresses that worked, and re-checks periodically. It also keeps the IP
addresses peers report seeing us at (identify's observed address), which the hole puncher
combines with our listen port.

Whom the client asks, and how often, is :class:`AskPolicy` (sans-IO). Asking costs the server a
dial, and with some implementations it costs us the connection: js-libp2p's server dials back
through its connection manager, which hands it the connection we asked on, and closes that
connection when done (@libp2p/autonat ``handleAutonatMessage``: ``openConnection`` without
``force``, then ``connection.close()``): its answer proves nothing and the peer is gone. So
servers that advertise :data:`DIAL_BACK_MARKER` (shardnet's: a fresh connection under a
throwaway identity) are asked first; others only when none of those is connected, one per check,
never js-libp2p; a server that does not answer, or whose connection goes as it answers, is left
alone for 30 minutes, doubling up to a day; and while the answer stays unknown the checks space
out from 15 s up to the normal interval.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from ..behaviour import Behaviour
from ..compat.identify import observed_addr_manager
from ..config import dial_place
from ..limits import Refusals
from .autonat_messages import (
    AUTONAT_PROTOCOL, AutoNATMessage, AutoNATType, Dial, DialResponse, DialStatus, decode_autonat, encode_autonat)
from .pbwire import FrameBuffer, MessageError
from .rawstream import close_quietly, read_message
from ..compat.swarm import is_relayed

log = logging.getLogger(__name__)
#: bad requests are logged at most once per peer and kind per 10 s
_refused = Refusals(log, logging.INFO)

IO_TIMEOUT = 10.0  # seconds for a request and its answer (the answer waits for the dial-back)
DIAL_BACK_TIMEOUT = 5.0  # seconds for one dial-back, handshakes included
MAX_DIAL_BACKS = 4  # concurrent dial-backs a node runs for others
MAX_ADDRS = 8  # addresses per request that a server considers
SERVERS_PER_CHECK = 3

PUBLIC, PRIVATE, UNKNOWN = "public", "private", "unknown"

#: Advertised (identify's protocol list, never opened) by servers that answer from a dial-back
#: on a fresh connection and leave the asker's connection alone.
DIAL_BACK_MARKER = "/shardnet/cap/autonat-fresh-dial-back/1.0.0"
IDENTIFY_PROTOCOL = "/ipfs/id/1.0.0"
#: Agent versions (prefixes) of servers that answer over the connection they were asked on and
#: then close it (see the module docstring): never asked.
REUSING_AGENTS = ("js-libp2p",)

#: kinds of AutoNAT server, as far as we know them
FRESH, REUSES, UNKNOWN_KIND = "fresh", "reuses", "unknown"

#: the longest wait between two looks for someone to ask and something to ask about
IDLE_LOOK_MAX_S = 10.0
NO_ANSWER_BACKOFF = 30 * 60.0  # seconds a server that did not answer is left alone (doubling)
REFUSED_BACKOFF = 5 * 60.0  # ... one that refused to dial (busy, same machine, bad request)
MAX_BACKOFF = 24 * 3600.0  # the longest; also for a server whose connection went as it answered
MAX_REMEMBERED = 1024  # servers the policy keeps state for
AGENT_LOOKUPS_PER_CHECK = 4  # identify exchanges (for an agent version) one check may make


@dataclass
class _ServerState:
    failures: int = 0
    not_before: float = 0.0  # (policy clock) when it may be asked again
    dial_backs: int = 0  # answers that came from a dial-back (OK or E_DIAL_ERROR)


class AskPolicy:
    """Whom to ask and when (sans-IO: the caller passes the clock and reports what happened).

    ``choose`` takes the connected servers with their kind (FRESH, REUSES, UNKNOWN_KIND) and
    returns whom to ask now: FRESH servers not backing off, those whose answers came from
    dial-backs first; only when there is none, one UNKNOWN_KIND server; REUSES never.
    ``next_delay`` is the pause before the next check."""

    def __init__(self, *, retry: float = 15.0, interval: float = 300.0, rng=None) -> None:
        self.retry, self.interval = retry, interval
        self.servers: dict[object, _ServerState] = {}
        self._unknown_streak = 0
        self._rng = rng or secrets.SystemRandom()

    def _state(self, server) -> _ServerState:
        st = self.servers.get(server)
        if st is None:
            if len(self.servers) >= MAX_REMEMBERED:  # forget the oldest entry
                self.servers.pop(next(iter(self.servers)))
            st = self.servers[server] = _ServerState()
        return st

    def backing_off(self, server, now: float) -> bool:
        st = self.servers.get(server)
        return st is not None and st.not_before > now

    def choose(self, servers: dict, now: float, n: int = SERVERS_PER_CHECK) -> list:
        ready = [s for s, kind in servers.items() if kind != REUSES and not self.backing_off(s, now)]
        self._rng.shuffle(ready)
        fresh = [s for s in ready if servers[s] == FRESH]
        if fresh:
            fresh.sort(key=lambda s: -min(self.servers.get(s, _ServerState()).dial_backs, 3))
            return fresh[:n]
        return [s for s in ready if servers[s] == UNKNOWN_KIND][:1]

    def answered(self, server, now: float, *, dial_back: bool) -> None:
        st = self._state(server)
        st.failures, st.not_before = 0, 0.0
        if dial_back:
            st.dial_backs += 1

    def refused(self, server, now: float) -> None:
        st = self._state(server)
        st.failures += 1
        st.not_before = now + min(MAX_BACKOFF, REFUSED_BACKOFF * 2 ** (st.failures - 1))

    def no_answer(self, server, now: float, *, dropped: bool = False) -> None:
        """No answer (error, timeout, closed stream); ``dropped``: the connection went too."""
        st = self._state(server)
        st.failures += 1
        st.not_before = now + (MAX_BACKOFF if dropped else
                               min(MAX_BACKOFF, NO_ANSWER_BACKOFF * 2 ** (st.failures - 1)))

    def next_delay(self, status: str) -> float:
        """Seconds to the next check: ``interval`` once known; while unknown 15 s, 30 s, ...
        up to ``interval``."""
        if status != UNKNOWN:
            self._unknown_streak = 0
            return self.interval
        delay = min(self.interval, self.retry * 2 ** self._unknown_streak)
        self._unknown_streak += 1
        return delay


@dataclass
class Reachability:
    status: str = UNKNOWN
    public_addrs: list[Multiaddr] = field(default_factory=list)  # confirmed by dial-backs
    checked_at: float | None = None  # Unix time
    answers: dict[str, str] = field(default_factory=dict)  # server -> "ok <addr>" or the error


@dataclass(frozen=True)
class AutoNATStatus:
    """What AutoNAT knows about our reachability (``AutoNAT.snapshot``), as plain data."""

    reachability: str = UNKNOWN
    public_addrs: list[str] = field(default_factory=list)  # confirmed by dial-backs
    checked_at: float | None = None  # Unix time
    answers: dict[str, str] = field(default_factory=dict)  # server -> "ok <addr>" or the error
    observed_ips: list[str] = field(default_factory=list)  # IPs peers see us at
    stats: dict[str, int] = field(default_factory=dict)


def _ip_of(addr: Multiaddr) -> str | None:
    for proto in ("ip4", "ip6"):
        try:
            return addr.value_for_protocol(proto)
        except Exception:
            continue
    return None


def _tcp_port(addr: Multiaddr) -> int | None:
    try:
        return int(addr.value_for_protocol("tcp"))
    except Exception:
        return None


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"


def dialable_tcp(addrs: list[Multiaddr]) -> list[Multiaddr]:
    """Plain IP/TCP addresses (no relay circuit, no loopback), without a /p2p part."""
    out, seen = [], set()
    for a in addrs:
        text = dial_place(a)
        if "/p2p-circuit" in text or text in seen:
            continue
        ma = Multiaddr(text)
        ip, port = _ip_of(ma), _tcp_port(ma)
        if ip is None or port is None or _is_loopback(ip) or ip in ("0.0.0.0", "::"):
            continue
        seen.add(text)
        out.append(ma)
    return out


class AutoNAT(Behaviour):
    """A node behaviour: both sides of AutoNAT, and what the node knows about its own
    reachability. ``serve``: answer others' dial-back requests; ``check``: ask others about us
    now and then (every ``interval`` s once known). Ready at once."""

    def __init__(self, *, serve: bool = True, check: bool = True, interval: float = 300.0) -> None:
        self.serves, self.checks, self.interval = serve, check, interval
        self.reachability = Reachability()
        self.observed: dict[str, set[ID]] = {}  # IP peers see us at -> who said so
        self.stats = Counter()
        self.changed = trio.Event()  # set (and replaced) whenever the status changes
        self._dial_backs = trio.Semaphore(MAX_DIAL_BACKS)
        self._serving: set[ID] = set()
        self._upgrader = None
        self.policy = AskPolicy()
        self._agents: dict[ID, str] = {}  # servers' agent versions (asked of unmarked servers only)

    def attach(self, node) -> None:
        self.node = node
        self._watch_observations()
        if self.serves:
            node.host.set_stream_handler(TProtocol(AUTONAT_PROTOCOL), self._handle)
            node.host.set_stream_handler(TProtocol(DIAL_BACK_MARKER), _refuse)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if self.checks:
            # ask once the node is up: with --relay, the relay client holds its first slot by
            # then, so what we advertise (and are checked at) includes our circuit addresses
            await self.node.started.wait()
            await self.keep_checking(interval=self.interval)
        await trio.sleep_forever()

    # -- what we know about ourselves ------------------------------------------------------------
    @property
    def status(self) -> str:
        return self.reachability.status

    def snapshot(self) -> AutoNATStatus:
        r = self.reachability
        return AutoNATStatus(r.status, [str(a) for a in r.public_addrs], r.checked_at, dict(r.answers),
                             sorted(self.observed), dict(self.stats))

    def _watch_observations(self) -> None:
        manager = observed_addr_manager(self.node.host)
        if manager is None:
            return
        record = manager.record_observation

        def record_observation(conn, observed, local_addrs) -> None:
            try:
                ip = _ip_of(observed)
                if ip and not _is_loopback(ip) and not is_relayed(conn):
                    self.observed.setdefault(ip, set()).add(conn.muxed_conn.peer_id)
            except Exception as e:  # an observation is a hint; a bad one must not break identify
                log.debug("ignoring observation %s: %s", observed, e)
            record(conn, observed, local_addrs)

        manager.record_observation = record_observation

    def listen_tcp(self) -> list[Multiaddr]:
        """Our own TCP listen addresses (per interface, loopback left out)."""
        return dialable_tcp(list(self.node.host.get_transport_addrs()) + self._expanded_listen())

    def _expanded_listen(self) -> list[Multiaddr]:
        return [a for a in self.node.host.get_addrs() if "/p2p-circuit" not in str(a)]

    def candidate_addrs(self) -> list[Multiaddr]:
        """Where others might reach us: confirmed public addresses, then every IP peers observed
        us at with our TCP listen port (a NAT that keeps source ports maps it there when we dial
        from that port, which is what hole punching does), then our listen addresses."""
        listen = self.listen_tcp()
        ports = sorted({p for p in (_tcp_port(a) for a in listen) if p})
        guesses = []
        for ip in sorted(self.observed, key=lambda i: -len(self.observed[i])):
            fam = "ip6" if ":" in ip else "ip4"
            guesses += [Multiaddr(f"/{fam}/{ip}/tcp/{port}") for port in ports]
        return dialable_tcp(self.reachability.public_addrs + guesses + listen)

    # -- the server --------------------------------------------------------------------------------
    async def _handle(self, raw) -> None:
        try:
            await self._serve(raw)
        except Exception as e:  # never let a bad request reach the swarm
            _refused.note(type(e).__name__, raw.muxed_conn.peer_id,
                          f"autonat request from {str(raw.muxed_conn.peer_id)[:16]}: {type(e).__name__}: {e}")
        finally:
            await close_quietly(raw)

    async def _serve(self, raw) -> None:
        asker = raw.muxed_conn.peer_id
        fb = FrameBuffer()
        try:
            with trio.fail_after(IO_TIMEOUT):
                msg = await read_message(raw, fb, decode_autonat)
        except (MessageError, trio.TooSlowError) as e:
            await _answer(raw, DialStatus.E_BAD_REQUEST, f"bad request: {e or 'timeout'}")
            return
        if msg.type != AutoNATType.DIAL or msg.dial is None:
            await _answer(raw, DialStatus.E_BAD_REQUEST, "expected DIAL")
            return
        if msg.dial.peer_id != asker.to_bytes():
            await _answer(raw, DialStatus.E_BAD_REQUEST, "a peer may only ask about itself")
            return
        seen_at = _remote_ip(raw)
        if is_relayed(raw.muxed_conn) or seen_at is None:
            await _answer(raw, DialStatus.E_DIAL_REFUSED, "request came through a relay: no IP to dial back")
            return
        targets = []
        for b in msg.dial.addrs[:MAX_ADDRS]:
            try:
                port = _tcp_port(Multiaddr(b))
            except Exception:
                continue
            fam = "ip6" if ":" in seen_at else "ip4"
            if port and f"/{fam}/{seen_at}/tcp/{port}" not in targets:
                targets.append(f"/{fam}/{seen_at}/tcp/{port}")
        if not targets:
            await _answer(raw, DialStatus.E_DIAL_REFUSED, "no TCP address to dial")
            return
        refusal = self._shares_our_network(seen_at)
        if refusal:
            self.stats["refused_local"] += 1
            await _answer(raw, DialStatus.E_DIAL_REFUSED, refusal)
            return
        if asker in self._serving or self._dial_backs.value == 0:
            self.stats["refused_busy"] += 1
            await _answer(raw, DialStatus.E_DIAL_REFUSED, "busy")
            return
        self._serving.add(asker)
        try:
            async with self._dial_backs:
                worked = await self._dial_back(asker, [Multiaddr(t) for t in targets])
        finally:
            self._serving.discard(asker)
        if worked is not None:
            self.stats["dial_backs_ok"] += 1
            await _answer(raw, DialStatus.OK, None, worked.to_bytes())
        else:
            self.stats["dial_backs_failed"] += 1
            await _answer(raw, DialStatus.E_DIAL_ERROR, f"no answer from {', '.join(targets)}")

    def _shares_our_network(self, ip: str) -> str | None:
        """Why a dial-back to ``ip`` would prove nothing, or None. A peer on this machine, or on
        our LAN while we are behind NAT (peers see us at an IP that no interface of ours has),
        reaches us without crossing the NAT that the question is about."""
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return "unreadable address"
        nets = _interface_networks()
        if any(addr == iface.ip for iface in nets):
            return "asked from this machine"
        ours = {str(iface.ip) for iface in nets}
        behind_nat = bool(self.observed) and not (set(self.observed) & ours)
        if behind_nat and any(addr in iface.network for iface in nets):
            return "asked from our LAN, and we are behind NAT"
        return None

    async def _dial_back(self, peer: ID, targets: list[Multiaddr]) -> Multiaddr | None:
        """The first target where ``peer`` completes a handshake, tried in parallel."""
        worked: list[Multiaddr] = []
        async with trio.open_nursery() as nursery:
            for t in targets:
                nursery.start_soon(self._try_dial_back, peer, t, worked, nursery.cancel_scope)
        return worked[0] if worked else None

    async def _try_dial_back(self, peer: ID, target: Multiaddr, worked: list, done: trio.CancelScope) -> None:
        from libp2p.io.trio import TrioTCPStream
        from libp2p.network.connection.raw_connection import RawConnection

        ip, port = _ip_of(target), _tcp_port(target)
        with trio.move_on_after(DIAL_BACK_TIMEOUT):
            try:
                stream = await trio.open_tcp_stream(ip, port)
            except OSError as e:
                log.debug("dial-back to %s: %s", target, e.strerror or e)
                return
            raw = RawConnection(TrioTCPStream(stream), True)
            try:
                upgrader = self._dial_back_upgrader()
                secured = await upgrader.upgrade_security(raw, True, peer)
                muxed = await upgrader.upgrade_connection(secured, peer)
                await muxed.close()
                worked.append(target)
                done.cancel()
            except Exception as e:
                log.debug("dial-back handshake with %s at %s: %s", str(peer)[:16], target, e)
            finally:
                await close_quietly(raw)

    def _dial_back_upgrader(self):
        """Noise and Yamux under a throwaway identity, made once: to the asker, the dial-back is
        a stranger's connection that does not compete with ours."""
        if self._upgrader is None:
            from libp2p import create_yamux_muxer_option
            from libp2p.transport.upgrader import TransportUpgrader

            from ..identity import generate
            from ..security import security_options

            # in a private swarm the stranger holds the swarm key too: members only answer members
            self._upgrader = TransportUpgrader(security_options(generate(), self.node.config.swarm_key),
                                               create_yamux_muxer_option())
        return self._upgrader

    # -- the client --------------------------------------------------------------------------------
    def servers(self) -> list[ID]:
        """Connected peers (over direct connections) that serve AutoNAT."""
        host = self.node.host
        out = []
        for peer in host.get_connected_peers():
            conns = host.get_network().get_connections(peer)
            if not conns or all(is_relayed(c) for c in conns):
                continue
            try:
                protocols = host.get_peerstore().get_protocols(peer)
            except Exception:
                continue
            if AUTONAT_PROTOCOL in protocols:
                out.append(peer)
        return out

    async def ask(self, server: ID, addrs: list[Multiaddr]) -> DialResponse:
        """One request: can ``server`` reach us at ``addrs``?"""
        with trio.fail_after(IO_TIMEOUT + DIAL_BACK_TIMEOUT):
            raw = await self.node.host.new_stream(server, [TProtocol(AUTONAT_PROTOCOL)])
            try:
                await raw.write(encode_autonat(AutoNATMessage(
                    AutoNATType.DIAL, dial=Dial(self.node.peer_id.to_bytes(), [a.to_bytes() for a in addrs]))))
                reply = await read_message(raw, FrameBuffer(), decode_autonat)
            finally:
                await close_quietly(raw)
        if reply.type != AutoNATType.DIAL_RESPONSE or reply.response is None:
            raise MessageError("expected DIAL_RESPONSE")
        return reply.response

    def _kind_by_protocols(self, server: ID) -> str:
        try:
            protocols = self.node.host.get_peerstore().get_protocols(server)
        except Exception:
            return UNKNOWN_KIND
        if DIAL_BACK_MARKER in protocols:
            return FRESH
        agent = self._agents.get(server)
        if agent is not None and agent.startswith(REUSING_AGENTS):
            return REUSES
        return UNKNOWN_KIND

    async def _agent_of(self, server: ID) -> str:
        """The server's agent version, from an identify exchange of our own ("" if none came)."""
        if server in self._agents:
            return self._agents[server]
        agent = ""
        try:
            with trio.fail_after(IO_TIMEOUT):
                raw = await self.node.host.new_stream(server, [TProtocol(IDENTIFY_PROTOCOL)])
                data = b""
                try:
                    while len(data) < 64 * 1024 and (chunk := await raw.read(4096)):
                        data += chunk
                except StreamEOF:  # py-libp2p's end of stream
                    pass
                finally:
                    await close_quietly(raw)
            from libp2p.identity.identify.identify import parse_identify_response

            agent = parse_identify_response(data).agent_version or ""
        except Exception as e:
            log.debug("identify of %s for its agent: %s: %s", str(server)[:16], type(e).__name__, e)
        if len(self._agents) >= MAX_REMEMBERED:
            self._agents.pop(next(iter(self._agents)))
        self._agents[server] = agent
        return agent

    async def server_kinds(self) -> dict[ID, str]:
        """The connected servers and what kind each is (agents looked up only while no server
        advertises the fresh-dial-back marker: only then would an unmarked one be asked)."""
        kinds = {s: self._kind_by_protocols(s) for s in self.servers()}
        if FRESH not in kinds.values():
            now = trio.current_time()
            unknown = [s for s, kind in kinds.items() if kind == UNKNOWN_KIND and not self.policy.backing_off(s, now)]
            if any(s in self._agents for s in unknown):
                unknown = []  # one we know is no js-libp2p: enough to ask
            secrets.SystemRandom().shuffle(unknown)
            for s in unknown[:AGENT_LOOKUPS_PER_CHECK]:
                if s not in self._agents:
                    agent = await self._agent_of(s)
                    kinds[s] = self._kind_by_protocols(s)
                    if kinds[s] != REUSES:
                        break  # found one to ask
                    log.info("not asking %s for AutoNAT: %s answers over the connection it is asked on "
                             "and then closes it", str(s)[:16], agent.split()[0] if agent else "it")
            # an unmarked server is asked only once we know its agent
            kinds = {s: k for s, k in kinds.items() if k != UNKNOWN_KIND or s in self._agents}
        return kinds

    async def check(self) -> Reachability:
        """Ask up to three servers (``policy`` picks them); public if any reached us, private if
        they tried and none did."""
        chosen = self.policy.choose(await self.server_kinds(), trio.current_time())
        if not chosen:
            return self.reachability  # nobody to ask now: what we knew stands
        addrs = self.candidate_addrs()
        answers: dict[str, str] = {}
        confirmed: list[Multiaddr] = []
        failed = 0
        for server in chosen:
            name = str(server)
            self.stats["asked"] += 1
            try:
                r = await self.ask(server, addrs)
            except Exception as e:
                dropped = self.node.link(server) is None
                self.policy.no_answer(server, trio.current_time(), dropped=dropped)
                self.stats["no_answer"] += 1
                answers[name] = f"no answer{' (and it closed the connection)' if dropped else ''}: " \
                                f"{type(e).__name__}: {e}"
                continue
            if r.status in (DialStatus.OK, DialStatus.E_DIAL_ERROR):
                self.policy.answered(server, trio.current_time(), dial_back=True)
            else:
                self.policy.refused(server, trio.current_time())
            if r.status == DialStatus.OK and r.addr:
                try:
                    confirmed.append(Multiaddr(r.addr))
                    answers[name] = f"ok {Multiaddr(r.addr)}"
                except Exception:
                    answers[name] = "ok (unreadable address)"
            elif r.status == DialStatus.E_DIAL_ERROR:
                failed += 1
                answers[name] = f"could not dial back: {r.text or ''}".strip()
            else:
                answers[name] = f"{_status_name(r.status)}: {r.text or ''}".strip()
        status = PUBLIC if confirmed else PRIVATE if failed else UNKNOWN
        self._set(Reachability(status, dialable_tcp(confirmed), time.time(), answers))
        return self.reachability

    def _set(self, new: Reachability) -> None:
        old = self.reachability.status
        self.reachability = new
        if new.status != old:
            detail = "; ".join(f"{k[:10]}…: {v}" for k, v in new.answers.items())
            log.info("reachability: %s (%s)", new.status, detail or "no AutoNAT server answered")
            self.changed.set()
            self.changed = trio.Event()

    async def keep_checking(self, *, first_delay: float = 1.0, interval: float = 300.0, retry: float = 15.0) -> None:
        """Check now and then: soon while unknown (backing off), every ``interval`` s once known."""
        self.policy.retry, self.policy.interval = retry, interval
        await trio.sleep(first_delay)
        idle = 1.0
        while True:
            if not self.candidate_addrs() or not self.policy.choose(
                    {s: self._kind_by_protocols(s) for s in self.servers()}, trio.current_time()):
                # nobody to ask yet (or loopback only: nothing to ask about): look again in 1 s,
                # then 2, 4, 8, then every 10 s (every second was 8 % of an idle loopback peer's
                # profile: each look lists and formats the host's addresses)
                await trio.sleep(idle)
                idle = min(IDLE_LOOK_MAX_S, idle * 2)
                continue
            idle = 1.0
            try:
                await self.check()
            except Exception as e:  # a check is best effort; the next one retries
                log.debug("autonat check failed: %s", e)
            await trio.sleep(self.policy.next_delay(self.status))


def _interface_networks() -> list:
    """This machine's interface addresses with their prefixes (ipaddress interfaces)."""
    import ifaddr

    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            text = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            try:
                out.append(ipaddress.ip_interface(f"{text.split('%')[0]}/{ip.network_prefix}"))
            except ValueError:
                continue
    return out


async def _refuse(raw) -> None:
    """A capability marker is advertised, never spoken."""
    await raw.reset()


async def _answer(raw, status: DialStatus, text: str | None, addr: bytes | None = None) -> None:
    with trio.move_on_after(IO_TIMEOUT):
        await raw.write(encode_autonat(AutoNATMessage(
            AutoNATType.DIAL_RESPONSE, response=DialResponse(int(status), text, addr))))


def _remote_ip(raw) -> str | None:
    try:
        remote = raw.muxed_conn.get_remote_address() if hasattr(raw.muxed_conn, "get_remote_address") else None
        if remote is None:
            remote = raw.get_remote_address()
        return remote[0] if remote else None
    except Exception:
        return None


def _status_name(status: int) -> str:
    try:
        return DialStatus(status).name
    except ValueError:
        return f"status {status}"
