"""shardnet's relay as infrastructure for go-libp2p (p2pd): the daemon, told that it is private
and given the shardnet relay as its static relay, reserves a slot there through go's autorelay;
a shardnet peer then reaches it through the circuit round after round, and the daemon's
connection to the relay and its slot survive every round."""

import time

import trio
from libp2p.peer.id import ID

from p2pd import P2pd, p2pd_available
from shardnet.protocols import activation as ap
from shardnet.transport import open_node
from shardnet.transport.nat.relay import RelayLimits

from checks import step_frame

import pytest

ROUNDS = 50


async def test_a_go_peer_reserved_on_a_shardnet_relay_is_reached_for_50_rounds(tmp_path, node_config):
    why = p2pd_available()
    if why:
        pytest.fail(f"go-libp2p daemon unavailable: {why}")
    frame = step_frame()

    async def go_echo(conn, info):  # length-framed: p2pd's stream bridge handles half-close poorly
        n = int.from_bytes(await conn.read_exactly(4), "big")
        await conn.stream.send_all(n.to_bytes(4, "big") + await conn.read_exactly(n))

    async with open_node(node_config(relay_service=RelayLimits(reservation_ttl=600))) as relay, \
            trio.open_nursery() as nursery:
        go = P2pd(tmp_path, "go-target", "-dhtClient", "-autoRelay", "-relayDiscovery=false", "-forceReachabilityPrivate",
                  "-trustedRelays", str(relay.listen_addrs[0]))
        try:
            await go.start()
            go_id = ID.from_base58(go.peer_id)
            await go.serve_protocol(ap.PROTOCOL_ID, go_echo, nursery, tmp_path / "handler.sock")
            with trio.fail_after(90):  # go's autorelay takes its time before it reserves
                while relay.relay_service.reservations.get(go_id, 0) <= time.time():
                    await trio.sleep(0.5)
            expire = relay.relay_service.reservations[go_id]
            relay_conns = [id(c) for c in relay.host.get_network().get_connections(go_id)]
            circuit = f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{go.peer_id}"
            for i in range(ROUNDS):
                async with open_node(node_config(auto_relays=0)) as dialler:
                    assert await dialler.connect(circuit) == go_id
                    assert [c["relayed"] for c in dialler.connections(go_id)] == [True]
                    async with await dialler.new_stream(go_id, ap.PROTOCOL_ID) as s:
                        await s.write(frame)
                        assert await s.read_exactly(len(frame), timeout=10) == frame, f"round {i}"
                assert [id(c) for c in relay.host.get_network().get_connections(go_id)] == relay_conns, \
                    f"round {i}: go's connection to the relay changed"
                assert relay.relay_service.reservations.get(go_id) == expire or \
                    relay.relay_service.reservations.get(go_id, 0) > time.time()
            assert relay.relay_service.stats["circuits"] >= ROUNDS
        finally:
            go.stop()
            nursery.cancel_scope.cancel()
