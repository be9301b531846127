"""What the js and go interop tests share: the activation frame they echo, spies on what
shardnet learns from a foreign peer, polling, and the relay check."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio
from libp2p.peer.id import ID

from shardnet.protocols import activation as ap
from shardnet.protocols import echo
from shardnet.transport import open_node
from shardnet.transport.config import parse_peer_addr


def step_frame() -> bytes:
    """An activation-protocol ``step`` frame with a [1, 4, 128] float32 tensor (2,134 bytes)."""
    payload = bytes(range(256)) * 8
    msg = ap.Step(b"\x07" * ap.SESSION_ID_BYTES, n=3, pos=11, dtype="float32", shape=[1, 4, 128],
                  payload=payload, logits_for=2, epoch=1)
    return ap.encode(msg)


async def echoed_frame(node, peer: str, frame: bytes) -> ap.Message:
    """Send ``frame`` on the activation protocol to ``peer``; the frame that comes back, which must
    be byte for byte the one sent, decoded."""
    async with await node.new_stream(peer, ap.PROTOCOL_ID) as s:
        await s.write(frame)
        back = await s.read_exactly(len(frame), timeout=10)
    assert back == frame
    [msg] = ap.ActivationDecoder().feed(back)
    return msg


def record_observations(node) -> list[str]:
    """The addresses peers report seeing us at (identify's observedAddr), as they arrive."""
    seen: list[str] = []
    manager = node.host._observed_addr_manager
    record = manager.record_observation

    def spy(conn, observed, local_addrs):
        seen.append(str(observed))
        return record(conn, observed, local_addrs)

    manager.record_observation = spy
    return seen


def protocols_of(node, peer: str) -> list[str]:
    """The protocols ``peer`` listed in identify, as shardnet's peerstore holds them."""
    try:
        return node.host.get_peerstore().get_protocols(ID.from_base58(peer))
    except Exception:
        return []


async def until(ask, ok=bool, *, retry_on: tuple[type[Exception], ...] = (), within: float = 20.0):
    """``await ask()`` once ``ok`` accepts it, or the last answer when time is up; errors in
    ``retry_on`` are retried until then (right after connecting, DHT routing tables may not hold
    the other side yet)."""
    deadline = trio.current_time() + within
    while True:
        try:
            got = await ask()
            if ok(got) or trio.current_time() > deadline:
                return got
        except retry_on:
            if trio.current_time() > deadline:
                raise
        await trio.sleep(0.5)


@asynccontextmanager
async def circuit_through(relay_addr: str, node_config):
    """Peer ``a`` reserves a slot on the foreign relay, ``b`` dials ``a`` through the circuit and
    8 activation frames are echoed end to end; yields (a, b) for more."""
    async with open_node(node_config(auto_relays=0)) as a, open_node(node_config(auto_relays=0)) as b:
        a.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        rsvp = await a.relay_client.reserve(parse_peer_addr(relay_addr))
        assert rsvp.expire > 0
        circuit = f"{relay_addr}/p2p-circuit/p2p/{a.peer_id}"
        assert circuit in [str(x) for x in a.listen_addrs]  # advertised next to the direct ones
        assert await b.connect(circuit) == a.peer_id
        assert [c["relayed"] for c in b.connections(a.peer_id)] == [True]
        frame = step_frame()
        async with await b.new_stream(a.peer_id, echo.PROTOCOL_ID) as s:
            for _ in range(8):
                await s.write(frame)
                assert await s.read_exactly(len(frame), timeout=10) == frame
        yield a, b
