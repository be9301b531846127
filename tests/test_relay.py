"""Circuit relay v2 between real hosts on loopback: reservations, circuits, limits, bad input."""

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import PeerInfo

from shardnet.transport import open_node
from shardnet.transport.errors import DialError
from shardnet.transport.nat.relay import RelayError, RelayLimits, is_relayed
from shardnet.transport.nat.relay_messages import (
    HOP_PROTOCOL, FrameBuffer, Status, decode_hop)


async def _echo(stream):
    while data := await stream.read_some():
        await stream.write(data)


def _info(node):
    return PeerInfo(node.peer_id, [node.listen_addrs[0]])


async def test_reserve_dial_and_talk_through_a_relay(loopback_config):
    async with open_node(loopback_config(relay_service=RelayLimits(reservation_ttl=60))) as relay, \
            open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        a.set_stream_handler("/t/echo", _echo)
        rsvp = await a.relay_client.reserve(_info(relay))
        assert rsvp.expire and relay.relay_service.reservations[a.peer_id] == rsvp.expire
        circuit = f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{a.peer_id}"
        assert circuit in [str(x) for x in a.listen_addrs]  # advertised with the direct addresses
        assert await b.connect(circuit) == a.peer_id
        assert [c["relayed"] for c in b.connections(a.peer_id)] == [True]
        s = await b.new_stream(a.peer_id, "/t/echo")
        payload = bytes(range(256)) * 4096  # 1 MiB both ways, end-to-end encrypted through the relay
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.write, payload)
            got = bytearray()
            while len(got) < len(payload):
                got += await s.read_some()
        assert bytes(got) == payload
        assert relay.relay_service.stats["bytes_relayed"] > 2 * len(payload)  # ciphertext both ways
        assert all(is_relayed(c) for c in a.host.get_network().get_connections(b.peer_id))


async def test_refusals_are_clear(loopback_config):
    limits = RelayLimits(max_reservations=1)
    async with open_node(loopback_config(relay_service=limits)) as relay, open_node(loopback_config()) as a, \
            open_node(loopback_config()) as b, open_node(loopback_config()) as plain:
        with pytest.raises(DialError, match="NO_RESERVATION"):  # nobody reserved a slot for a yet
            await b.connect(f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{a.peer_id}")
        await a.relay_client.reserve(_info(relay))
        with pytest.raises(RelayError, match="RESERVATION_REFUSED") as e:  # the one slot is taken
            await b.relay_client.reserve(_info(relay))
        assert e.value.status == Status.RESERVATION_REFUSED
        with pytest.raises(RelayError, match="not a relay"):
            await a.relay_client.reserve(_info(plain))


@pytest.mark.parametrize("garbage", [b"\x05\x08\x07\x00\x00\x00", b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80",
                                     b"\x03\x08\x02\x00"])
async def test_malformed_hop_requests_get_a_status_and_harm_nothing(loopback_config, garbage):
    async with open_node(loopback_config(relay_service=RelayLimits())) as relay, \
            open_node(loopback_config()) as a:
        await a.connect(relay.listen_addrs[0])
        raw = await a.host.new_stream(relay.peer_id, [TProtocol(HOP_PROTOCOL)])
        await raw.write(garbage)
        fb = FrameBuffer()
        with trio.fail_after(15):
            while (body := fb.next_body()) is None:
                fb.feed(await raw.read(4096))
        assert decode_hop(body).status in (Status.MALFORMED_MESSAGE, Status.UNEXPECTED_MESSAGE)
        assert (await a.relay_client.reserve(_info(relay))).expire  # the relay still serves


async def test_circuit_data_limit_ends_the_circuit(loopback_config):
    async with open_node(loopback_config(relay_service=RelayLimits(circuit_bytes=64 << 10))) as relay, \
            open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        a.set_stream_handler("/t/echo", _echo)
        await a.relay_client.reserve(_info(relay))
        await b.connect(f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{a.peer_id}")
        s = await b.new_stream(a.peer_id, "/t/echo")
        with pytest.raises(Exception):
            with trio.fail_after(30):
                for _ in range(64):
                    await s.write(b"x" * 8192)
                    await s.read_some()
        assert relay.relay_service.stats["circuits_over_data_limit"] >= 1

