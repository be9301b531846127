"""Circuit relay v2 between real hosts on loopback: reservations, circuits, limits, bad input."""

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import PeerInfo

from shardnet.testing.factories import echo_handler
from shardnet.transport import open_node
from shardnet.transport.errors import DialError
from shardnet.transport.nat.relay import RelayError, RelayLimits, is_relayed
from shardnet.transport.nat.relay_messages import (
    HOP_PROTOCOL,
    FrameBuffer,
    Status,
    decode_hop,
)


def _info(node):
    return PeerInfo(node.peer_id, [node.listen_addrs[0]])


async def test_reserve_dial_and_talk_through_a_relay(loopback_config):
    async with open_node(loopback_config(relay_service=RelayLimits(reservation_ttl=60))) as relay, \
            open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        a.set_stream_handler("/t/echo", echo_handler)
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
        a.set_stream_handler("/t/echo", echo_handler)
        await a.relay_client.reserve(_info(relay))
        await b.connect(f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{a.peer_id}")
        s = await b.new_stream(a.peer_id, "/t/echo")
        with pytest.raises(Exception):
            with trio.fail_after(30):
                for _ in range(64):
                    await s.write(b"x" * 8192)
                    await s.read_some()
        assert relay.relay_service.stats["circuits_over_data_limit"] >= 1



async def _raw_circuit(relay, a, b, on_target):
    """b opens a hop CONNECT to a by hand; a's stop handler is replaced by ``on_target(raw)``,
    which gets the circuit's bytes with no libp2p connection on top. Returns b's raw stream."""
    from shardnet.transport.nat.rawstream import read_message
    from shardnet.transport.nat.relay_messages import (
        STOP_PROTOCOL,
        HopMessage,
        HopType,
        Peer,
        StopMessage,
        StopType,
        decode_stop,
        encode_hop,
        encode_stop,
    )

    async def stop(raw):
        fb = FrameBuffer()
        msg = await read_message(raw, fb, decode_stop)
        assert msg.type == StopType.CONNECT
        await raw.write(encode_stop(StopMessage(StopType.STATUS, status=Status.OK)))
        await on_target(raw)

    a.host.set_stream_handler(TProtocol(STOP_PROTOCOL), stop)
    await b.connect(relay.listen_addrs[0])
    raw = await b.host.new_stream(relay.peer_id, [TProtocol(HOP_PROTOCOL)])
    await raw.write(encode_hop(HopMessage(HopType.CONNECT, peer=Peer(a.peer_id.to_bytes()))))
    from shardnet.transport.nat.rawstream import read_message as rm
    reply = await rm(raw, FrameBuffer(), decode_hop)
    assert reply.status == Status.OK
    return raw


async def _read_to_end(raw) -> tuple[int, str]:
    """(bytes read, how it ended: "eof" or "reset")."""
    n = 0
    try:
        while data := await raw.read(1 << 16):
            n += len(data)
    except EOFError:
        pass
    except Exception as e:
        return n, "reset" if "reset" in f"{type(e).__name__} {e}".lower() else f"error {type(e).__name__}: {e}"
    return n, "eof"


async def test_a_circuit_cut_at_its_data_limit_is_a_reset_at_both_ends_and_logged(loopback_config, caplog):
    limit = 64 << 10
    at_target = {}
    done = trio.Event()

    async def target(raw):
        at_target["end"] = await _read_to_end(raw)
        done.set()

    caplog.set_level("INFO", logger="shardnet.transport.nat.relay")
    async with open_node(loopback_config(relay_service=RelayLimits(circuit_bytes=limit))) as relay, \
            open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        await a.relay_client.reserve(_info(relay))
        raw = await _raw_circuit(relay, a, b, target)
        with trio.fail_after(20):
            try:
                for _ in range(32):
                    await raw.write(b"x" * 8192)  # twice the limit
            except Exception:
                pass
            await done.wait()
            at_source = await _read_to_end(raw)
        n, how = at_target["end"]
        assert how == "reset" and n <= limit, at_target  # never a clean end after a truncation
        assert at_source[1] == "reset", at_source
        line = [r.getMessage() for r in caplog.records if "cut:" in r.getMessage()]
        assert line and f"forward data limit of {limit} bytes" in line[0] and f"{n} bytes forward" in line[0], line


async def test_a_circuit_end_that_closes_its_half_still_gets_the_answer(loopback_config, caplog):
    """Half-close goes through the relay: a request ending in EOF, then the answer back."""
    async def target(raw):
        n, how = await _read_to_end(raw)
        await raw.write(f"{n} {how}".encode())
        await raw.close()

    caplog.set_level("INFO", logger="shardnet.transport.nat.relay")
    async with open_node(loopback_config(relay_service=RelayLimits())) as relay, \
            open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        await a.relay_client.reserve(_info(relay))
        raw = await _raw_circuit(relay, a, b, target)
        with trio.fail_after(20):
            await raw.write(b"q" * 100_000)
            await raw.close()
            got = b""
            try:
                while data := await raw.read(1024):
                    got += data
            except EOFError:  # how py-libp2p's streams end
                pass
        assert got == b"100000 eof"
        with trio.fail_after(5):
            while not any("closed by both ends" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.05)
