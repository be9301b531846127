"""The core behaviours every node runs (bootstrap supervision, discovery, keepalive), the NAT
behaviours' snapshots, and HeldError: driven over fakes of the node, on trio's mock clock."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from libp2p.peer.peerinfo import PeerInfo

from shardnet.errors import DialError, HeldError
from shardnet.transport import identity
from shardnet.transport.bootstrap import BootstrapStatus, BootstrapSupervisor
from shardnet.transport.config import NodeConfig
from shardnet.transport.discovery import MAX_DISCOVERED, Discovery
from shardnet.transport.keepalive import Keepalive, KeepaliveStatus
from shardnet.transport.nat.autonat import AutoNAT, AutoNATStatus
from shardnet.transport.nat.holepunch import HolePuncher, HolePunchStatus
from shardnet.transport.nat.relay import RelayClient, RelayClientStatus, RelayService, RelayServiceStatus


def _peer():
    return identity.peer_id_of(identity.generate())


class FakeMuxed:
    def __init__(self, peer, sent: float | None) -> None:
        self.peer_id = peer
        self._ping_event = trio.Event()
        self._ping_sent_time = sent or 0.0


class FakeConn:
    def __init__(self, peer, sent: float | None) -> None:
        self.muxed_conn = FakeMuxed(peer, sent)
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class FakeNetwork:
    def __init__(self) -> None:
        self.conns: list[FakeConn] = []
        self.looks = 0  # calls of get_connections

    def get_connections(self, peer=None):
        self.looks += 1
        return list(self.conns)


class FakeHost:
    def __init__(self) -> None:
        self.network = FakeNetwork()
        self.connected: set = set()

    def get_network(self):
        return self.network

    def get_connected_peers(self):
        return list(self.connected)


class FakeNode:
    """What the core behaviours use of a node."""

    def __init__(self) -> None:
        self.peer_id = _peer()
        self.host = FakeHost()
        self.dials = 0
        self.links_changes = 0
        self.discovery = Discovery(NodeConfig())
        self.discovery.attach(self)
        self.autonat = None

    async def connect(self, info, timeout=None):
        self.dials += 1
        raise DialError("could not connect: Connection refused")

    def note_links_changed(self) -> None:
        self.links_changes += 1


def test_keepalive_closes_a_connection_whose_ping_went_unanswered_and_counts_it():
    async def main() -> None:
        node = FakeNode()
        keepalive = Keepalive(NodeConfig(keepalive_interval=10.0, keepalive_timeout=15.0))
        assert keepalive.snapshot() == KeepaliveStatus(timeout=15.0, closed=0)
        await trio.sleep(1)  # (a ping sent at time 0 reads as none sent)
        alive, dead = FakeConn(_peer(), None), FakeConn(_peer(), trio.current_time())
        node.host.network.conns = [alive, dead]
        async with trio.open_nursery() as nursery:
            await nursery.start(keepalive.run, node)
            await trio.sleep(14)
            assert not dead.closed
            await trio.sleep(3)
            assert dead.closed and not alive.closed and keepalive.snapshot().closed >= 1
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_keepalive_looks_at_the_connections_once_a_timeout_not_every_second():
    """Going over every connection each second grew with the swarm: the connections are looked
    at once a timeout while no ping is out, and a ping sent in between is still found unanswered
    within a second of the timeout."""

    async def main() -> None:
        node = FakeNode()
        keepalive = Keepalive(NodeConfig(keepalive_interval=10.0, keepalive_timeout=15.0))
        await trio.sleep(1)
        quiet = FakeConn(_peer(), None)
        node.host.network.conns = [quiet]
        async with trio.open_nursery() as nursery:
            await nursery.start(keepalive.run, node)
            await trio.sleep(60)
            assert node.host.network.looks <= 60 / 15 + 1
            late = FakeConn(_peer(), trio.current_time() + 0.5)  # pinged half a second after a look
            node.host.network.conns.append(late)
            await trio.sleep(15.0)
            assert not late.closed
            await trio.sleep(2.0)
            assert late.closed and not quiet.closed
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_behind_nat_idle_connections_are_pinged_at_most_every_minute():
    """A NAT keeps an idle TCP mapping for minutes on some routers: while AutoNAT says we are
    private, the longest keepalive interval is 60 s, not keepalive_max_interval."""
    from types import SimpleNamespace

    from shardnet.transport.compat import yamux
    from shardnet.transport.keepalive import PRIVATE_MAX_INTERVAL_S

    from libp2p.stream_muxer.yamux import yamux as upstream

    before = yamux.QUIET_MAX_INTERVAL, upstream.RTT_MEASURE_INTERVAL

    async def main() -> None:
        node = FakeNode()
        node.autonat = SimpleNamespace(status="unknown")
        keepalive = Keepalive(NodeConfig(keepalive_interval=10.0, keepalive_max_interval=300.0))
        async with trio.open_nursery() as nursery:
            await nursery.start(keepalive.run, node)
            await trio.sleep(2)
            assert yamux.QUIET_MAX_INTERVAL == 300.0 and not keepalive.private
            node.autonat.status = "private"
            await trio.sleep(2)
            assert yamux.QUIET_MAX_INTERVAL == PRIVATE_MAX_INTERVAL_S == 60.0 and keepalive.private
            node.autonat.status = "public"
            await trio.sleep(2)
            assert yamux.QUIET_MAX_INTERVAL == 300.0
            nursery.cancel_scope.cancel()

    try:
        yamux.set_keepalive_interval(10.0, 300.0)
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        yamux.QUIET_MAX_INTERVAL, upstream.RTT_MEASURE_INTERVAL = before


def test_keepalive_timeout_stays_below_the_next_ping():
    # py-libp2p pings anew 10 s + interval after an unanswered ping: a longer timeout never fires
    assert Keepalive(NodeConfig(keepalive_interval=2.0, keepalive_timeout=60.0)).snapshot().timeout == 11.0


def test_bootstrap_supervision_redials_with_backoff_and_reports_why():
    async def main() -> None:
        node = FakeNode()
        boot = PeerInfo(_peer(), [])
        sup = BootstrapSupervisor([boot, PeerInfo(node.peer_id, [])], NodeConfig(reconnect_initial=1.0,
                                                                                reconnect_max=4.0))
        sup.attach(node)
        assert sup.snapshot() == BootstrapStatus(peers=[str(boot.peer_id)])  # never ourselves
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run, node)
            await trio.sleep(20)
            nursery.cancel_scope.cancel()
        # backoff 1, 2, 4, 4, ... (jittered by a quarter either way): about 7 dials in 20 s
        assert 4 <= node.dials <= 9 and node.links_changes == node.dials
        status = sup.snapshot()
        assert status.connected == [] and "Connection refused" in status.errors[str(boot.peer_id)]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_discovery_notes_each_peer_once_and_forgets_the_oldest():
    node = FakeNode()
    told = []
    d = Discovery(NodeConfig(), told.append)
    d.attach(node)
    a, b = _peer(), _peer()
    for p in (a, b, a, node.peer_id):
        d.note(p)
    assert list(d.discovered) == [a, b] and told == [a, b]
    assert d.snapshot().discovered == 2 and d.snapshot().walks == 0
    for i in range(MAX_DISCOVERED - 2):
        d.discovered[f"fake-{i}"] = 0.0
    d.note(_peer())
    assert len(d.discovered) == MAX_DISCOVERED and a not in d.discovered


def test_nat_behaviours_snapshots_are_plain_data():
    assert AutoNAT().snapshot() == AutoNATStatus()
    assert AutoNAT().snapshot().reachability == "unknown"
    assert HolePuncher().snapshot() == HolePunchStatus()
    assert RelayClient().snapshot() == RelayClientStatus()
    service = RelayService()
    service.reservations[_peer()] = 123.0
    assert service.snapshot().reservations and service.snapshot().circuits == 0
    assert isinstance(service.snapshot(), RelayServiceStatus)


class Boom(Exception):
    pass


def test_held_error_leaves_the_nursery_as_itself():
    async def main() -> None:
        held = HeldError()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            try:
                with held:
                    raise Boom("from the body")
            finally:
                nursery.cancel_scope.cancel()
        assert isinstance(held.error, Boom)
        held.reraise()

    with pytest.raises(Boom, match="from the body"):
        trio.run(main)
    HeldError().reraise()  # nothing held: nothing raised
