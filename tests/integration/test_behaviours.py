"""Node behaviours (shardnet/transport/behaviour.py): composed by open_node, added to a running
node, found by type, started in order and stopped with the node."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from shardnet.protocols import echo
from shardnet.transport import Behaviour, ShardnetError, default_behaviours, open_node
from shardnet.transport.nat.autonat import AutoNAT
from shardnet.transport.nat.holepunch import HolePuncher
from shardnet.transport.nat.relay import RelayClient, RelayLimits, RelayService

ECHO_AGAIN = "/test/echo-again/1.0.0"


class EchoBehaviour:
    """A plain object with ``run``: no base class needed."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.log = log if log is not None else []
        self.started = False
        self.stopped = False

    async def run(self, node, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        node.set_stream_handler(ECHO_AGAIN, echo.serve)
        await trio.sleep(0.05)  # readiness may take time: the node waits for it
        self.started = True
        self.log.append(type(self).__name__)
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self.stopped = True


class Second(EchoBehaviour):
    pass


class Boom(Exception):
    pass


class FailsBeforeReady:
    async def run(self, node, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(0)
        raise Boom("could not get ready")


async def test_open_node_starts_behaviours_in_order_before_yielding_and_stops_them_with_it(loopback_config):
    order: list[str] = []
    mine, second = EchoBehaviour(order), Second(order)
    cfg = loopback_config()
    async with open_node(cfg, behaviours=[*default_behaviours(cfg), mine, second]) as node, \
            open_node(loopback_config()) as other:
        assert mine.started and second.started and order == ["EchoBehaviour", "Second"]
        assert node.behaviour(EchoBehaviour) is mine  # by type (the first that is one)
        assert node.behaviour(Second) is second
        await other.connect(node.listen_addrs[0])
        async with await other.new_stream(node.peer_id, ECHO_AGAIN) as s:
            assert await echo.echo_once(s, b"hello behaviour") == b"hello behaviour"
        assert not mine.stopped
    assert mine.stopped and second.stopped


async def test_a_behaviour_failing_before_it_is_ready_fails_open_node_with_its_error(loopback_config):
    later = EchoBehaviour()
    entered = False
    with pytest.raises(Boom, match="could not get ready"):
        async with open_node(loopback_config(), behaviours=[FailsBeforeReady(), later]):
            entered = True
    assert not entered and not later.started  # the ones after it never start


async def test_default_behaviours_follow_the_config_and_keep_their_old_names(loopback_config):
    async with open_node(loopback_config()) as plain, \
            open_node(loopback_config(relay_service=RelayLimits(), hole_punch=False)) as relay:
        assert isinstance(plain.relay_client, RelayClient) and plain.relay_client is plain.behaviour(RelayClient)
        assert isinstance(plain.autonat, AutoNAT) and plain.autonat is plain.behaviour(AutoNAT)
        assert isinstance(plain.holepunch, HolePuncher) and plain.holepunch.punches
        assert plain.relay_service is None and plain.behaviour(RelayService) is None
        assert relay.relay_service is relay.behaviour(RelayService) and not relay.holepunch.punches
        with pytest.raises(AttributeError):
            plain.autonat = None  # read-only: the registry is the one place behaviours live
    # a stopped node's behaviours stay readable (stats after the fact)
    assert plain.autonat is not None and relay.relay_service is not None


async def test_a_node_without_the_default_behaviours(loopback_config):
    async with open_node(loopback_config(), behaviours=[]) as node:
        assert node.relay_client is None and node.autonat is None and node.holepunch is None
        assert node.nat_status()["reachability"] == "unknown"
        assert node.behaviours == []


async def test_add_behaviour_on_a_running_node_waits_until_it_is_ready(loopback_config):
    async with open_node(loopback_config()) as node:
        assert node.behaviour(EchoBehaviour) is None
        b = EchoBehaviour()
        assert await node.add_behaviour(b) is b
        assert b.started and node.behaviour(EchoBehaviour) is b and b in node.behaviours
        with pytest.raises(Boom):
            await node.add_behaviour(FailsBeforeReady())
        assert node.behaviour(FailsBeforeReady) is None
        node.remove_behaviour(b)
        assert node.behaviour(EchoBehaviour) is None
        with trio.fail_after(5):
            while not b.stopped:
                await trio.sleep(0.01)
        assert node.peer_id is not None and node.nursery is not None  # the node stays up
    assert node.nursery is None
    with pytest.raises(ShardnetError, match="not running"):
        await node.add_behaviour(EchoBehaviour())


class Counter(Behaviour):
    """A base-class behaviour: work spawned before it runs waits for it."""

    def __init__(self) -> None:
        self.ticks = 0

    async def tick(self, n: int) -> None:
        for _ in range(n):
            await trio.sleep(1.0)
            self.ticks += 1


async def test_ensure_behaviour_registers_at_once_and_runs_spawned_work_in_the_behaviour(loopback_config):
    async with open_node(loopback_config()) as node:
        c = node.ensure_behaviour(Counter, Counter)
        assert node.ensure_behaviour(Counter, Counter) is c  # one per node
        c.spawn(c.tick, 2)  # queued: its run has not started yet
        with trio.fail_after(10):
            while c.ticks < 2:
                await trio.sleep(0.05)
        node.remove_behaviour(c)
        await trio.sleep(0.05)
        c.spawn(c.tick, 1)  # stopped: work is dropped, not run in someone else's nursery
        await trio.sleep(1.2)
        assert c.ticks == 2


def test_behaviour_base_runs_its_spawned_work_until_cancelled():
    clock = trio.testing.MockClock(autojump_threshold=0)
    node = object()

    async def main() -> None:
        c = Counter()
        c.spawn(c.tick, 100)
        async with trio.open_nursery() as nursery:
            await nursery.start(c.run, node)
            assert c.node is node
            await trio.sleep(10.5)
            assert c.ticks == 10
            nursery.cancel_scope.cancel()
        assert c._tasks is None
        c.spawn(c.tick, 1)  # after the run: dropped
        await trio.sleep(5)
        assert c.ticks == 10

    trio.run(main, clock=clock)


async def test_the_relay_client_is_ready_once_it_holds_a_slot(loopback_config):
    async with open_node(loopback_config(relay_service=RelayLimits())) as relay:
        cfg = loopback_config(relays=[str(relay.listen_addrs[0])])
        async with open_node(cfg) as node:
            assert node.relay_client.circuit_addrs  # no polling: open_node waited for it
            assert relay.relay_service.reservations.get(node.peer_id)


async def test_the_core_behaviours_run_on_every_node_and_report_their_status(loopback_config):
    async with open_node(loopback_config(), behaviours=[]) as boot:
        async with open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])])) as node:
            await node.wait_bootstrapped()
            status = node.status()
            assert list(status)[:4] == ["BootstrapSupervisor", "Discovery", "Keepalive", "ConnectionManager"]
            assert status["BootstrapSupervisor"]["connected"] == [str(boot.peer_id)]
            assert {"AutoNAT", "HolePuncher", "RelayClient"} <= set(status)
            assert status["AutoNAT"]["reachability"] == node.nat_status()["reachability"]
            assert not any(b in node.behaviours for b in node.core_behaviours)  # the pluggable ones only
            with trio.fail_after(10):
                while node.discovery.snapshot().walks == 0 or boot.peer_id not in node.discovered:
                    await trio.sleep(0.05)
        assert list(boot.status()) == ["BootstrapSupervisor", "Discovery", "Keepalive", "ConnectionManager"]


class Tally:
    """Node-wide state with no work of its own: not a behaviour."""

    def __init__(self, node) -> None:
        self.node = node


async def test_the_behaviour_registry_holds_only_what_runs(loopback_config):
    async with open_node(loopback_config(), behaviours=[]) as node:
        with pytest.raises(TypeError, match="no run"):
            node.ensure_behaviour(Tally)
        assert node.behaviour(Tally) is None and node.behaviours == []


async def test_discovery_walks_less_often_while_it_finds_nothing_new(loopback_config):
    """Kademlia's refresh, not a fixed beat: after a walk that finds no new peer the next comes a
    random share of the ceiling later, then at the ceiling, and a kick walks at once and goes
    back to the short beat."""
    async with open_node(loopback_config()) as boot, \
            open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])], discovery_interval=0.1,
                                      discovery_max_interval=0.8)) as node:
        with trio.fail_after(20):
            while node.discovery.interval < 0.8:
                await trio.sleep(0.05)
        walks = node.discovery.snapshot().walks
        await trio.sleep(1.7)
        assert node.discovery.snapshot().walks - walks <= 3  # ~every 0.8 s now, not every 0.1 s
        async with open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])])) as newcomer:
            node.discovery.kick()
            with trio.fail_after(10):  # (the interval is set after the walk's top-up dials)
                while newcomer.peer_id not in node.discovery.discovered or node.discovery.interval >= 0.8:
                    await trio.sleep(0.05)


async def test_the_connection_manager_trims_idle_connections_over_the_high_watermark(loopback_config):
    """Above the high watermark, idle connections close down to the low one; a bootstrap peer, a
    protected peer and a connection carrying a stream stay."""
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config(), behaviours=[]))
        hub = await stack.enter_async_context(open_node(loopback_config(
            bootstrap=[str(boot.listen_addrs[0])], low_watermark=2, high_watermark=3, connection_grace_s=0.0),
            behaviours=[]))
        others = [await stack.enter_async_context(open_node(loopback_config(), behaviours=[])) for _ in range(5)]
        others[1].set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        for o in others:
            await hub.connect(f"{o.listen_addrs[0]}/p2p/{o.peer_id}")
        await hub.wait_bootstrapped()
        hub.connection_manager.protect(others[0].peer_id, "successor")
        busy = await hub.new_stream(others[1].peer_id, echo.PROTOCOL_ID)
        stay = {boot.peer_id, others[0].peer_id, others[1].peer_id}
        with trio.fail_after(20):
            while set(hub.host.get_connected_peers()) != stay:  # (a connection busy a moment waits a round)
                hub.connection_manager.trim_soon()
                await trio.sleep(0.1)
        assert hub.connection_manager.snapshot().trimmed == 3
        assert await echo.echo_once(busy, b"still here") == b"still here"
        await busy.close()
