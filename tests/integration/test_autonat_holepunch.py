"""AutoNAT and DCUtR between real hosts on loopback: the dial-back machinery, the service's
refusals, bad input on both protocols, and what a node without a routable address does. The
NAT behaviour itself (private vs public, punching through cone and symmetric NATs) is tested in
the NAT lab (test_nat_traversal.py)."""

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import PeerInfo

from shardnet.transport import open_node
from shardnet.transport.nat.autonat_messages import (
    AUTONAT_PROTOCOL,
    AutoNATMessage,
    AutoNATType,
    Dial,
    DialStatus,
    decode_autonat,
    encode_autonat,
)
from shardnet.transport.nat.holepunch_messages import DCUTR_PROTOCOL
from shardnet.transport.nat.pbwire import FrameBuffer
from shardnet.transport.nat.relay import RelayLimits


async def _ask_raw(node, server, frame: bytes):
    raw = await node.host.new_stream(server.peer_id, [TProtocol(AUTONAT_PROTOCOL)])
    await raw.write(frame)
    fb = FrameBuffer()
    with trio.fail_after(10):
        while (body := fb.next_body()) is None:
            data = await raw.read(4096)
            assert data, "the server closed without answering"
            fb.feed(data)
    return decode_autonat(body)


async def test_dial_back_proves_the_key_holder_answers(loopback_config):
    async with open_node(loopback_config()) as server, open_node(loopback_config()) as asker, \
            open_node(loopback_config()) as other:
        addr = asker.listen_addrs[0].decapsulate(f"/p2p/{asker.peer_id}")
        assert await server.autonat._dial_back(asker.peer_id, [addr]) == addr
        # the dial-back came under a throwaway identity and was closed: no connection stays
        with trio.fail_after(5):
            while asker.peers():
                await trio.sleep(0.05)
        assert server.peer_id not in asker.peers()
        # another peer's key at that address, or nobody listening: no
        assert await server.autonat._dial_back(other.peer_id, [addr]) is None
        dead = trio.socket.socket()
        await dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
        dead.close()
        from multiaddr import Multiaddr
        assert await server.autonat._dial_back(asker.peer_id, [Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")]) is None


async def test_service_refuses_what_it_cannot_answer_honestly(loopback_config):
    async with open_node(loopback_config()) as server, open_node(loopback_config()) as asker:
        await asker.connect(server.listen_addrs[0])
        me = asker.listen_addrs[0].decapsulate(f"/p2p/{asker.peer_id}").to_bytes()
        # about somebody else
        r = await _ask_raw(asker, server, encode_autonat(AutoNATMessage(
            AutoNATType.DIAL, dial=Dial(server.peer_id.to_bytes(), [me]))))
        assert r.response.status == DialStatus.E_BAD_REQUEST and "itself" in r.response.text
        # from this very machine: a dial-back would not cross any NAT
        r = await _ask_raw(asker, server, encode_autonat(AutoNATMessage(
            AutoNATType.DIAL, dial=Dial(asker.peer_id.to_bytes(), [me]))))
        assert r.response.status == DialStatus.E_DIAL_REFUSED and "this machine" in r.response.text
        # garbage
        r = await _ask_raw(asker, server, b"\x05\x08\x07\x00\x00\x00")
        assert r.response.status == DialStatus.E_BAD_REQUEST
        assert server.autonat.stats["refused_local"] == 1
        assert await asker.ping(server.peer_id) > 0  # nothing else broke


async def test_loopback_nodes_do_not_ask_and_stay_unknown(loopback_config):
    async with open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        await a.connect(b.listen_addrs[0])
        assert a.autonat.servers() == [b.peer_id] or a.autonat.servers() == []
        assert a.autonat.candidate_addrs() == []  # loopback is never offered to anyone
        await trio.sleep(2.5)
        assert a.autonat.status == "unknown" and b.autonat.status == "unknown"


async def test_hole_punch_without_an_address_to_offer_is_reported(loopback_config):
    async with open_node(loopback_config(relay_service=RelayLimits())) as relay, \
            open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        await a.relay_client.reserve(PeerInfo(relay.peer_id, [relay.listen_addrs[0]]))
        await b.connect(f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{a.peer_id}")
        with trio.fail_after(10):
            while b.peer_id not in a.holepunch.outcomes:
                await trio.sleep(0.05)
        outcome = a.holepunch.outcomes[b.peer_id]
        assert outcome.ok is False and "no address" in outcome.detail
        assert a.nat_status()["hole_punches"][str(b.peer_id)]["ok"] is False
        assert all(c["relayed"] for c in b.connections(a.peer_id))  # still talking via the relay


async def test_garbage_on_dcutr_resets_the_stream_only(loopback_config):
    async with open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        await b.connect(a.listen_addrs[0])
        for garbage in (b"\xff" * 11, b"\x02\x08\x01", b"\x03\x08\xac\x02"):  # bad prefix, bad type, SYNC first
            raw = await b.host.new_stream(a.peer_id, [TProtocol(DCUTR_PROTOCOL)])
            await raw.write(garbage)
            with trio.fail_after(10):
                try:
                    while await raw.read(4096):
                        pass
                except Exception:
                    pass  # reset: fine
        assert await b.ping(a.peer_id) > 0
        assert a.holepunch.outcomes == {}



async def test_a_silently_dead_connection_is_closed_by_keepalive(loopback_config):
    """A path that stops carrying packets without closing (a NAT that forgot its mapping) is
    found by keepalive and closed, so that reconnection can start."""
    frozen = trio.Event()

    async def pipe(src, dst):
        try:
            while data := await src.receive_some(65536):
                if frozen.is_set():
                    await trio.sleep_forever()  # swallow everything, close nothing
                await dst.send_all(data)
        except trio.BrokenResourceError:
            pass

    cfg = dict(keepalive_interval=0.5, keepalive_max_interval=1.0, keepalive_timeout=2.0)
    async with open_node(loopback_config(**cfg)) as a, open_node(loopback_config(**cfg)) as b, \
            trio.open_nursery() as nursery:
        port = int(str(b.listen_addrs[0]).split("/tcp/")[1].split("/")[0])

        async def forward(client):
            upstream = await trio.open_tcp_stream("127.0.0.1", port)
            async with trio.open_nursery() as n:
                n.start_soon(pipe, client, upstream)
                n.start_soon(pipe, upstream, client)

        listeners = await nursery.start(trio.serve_tcp, forward, 0)
        proxy_port = listeners[0].socket.getsockname()[1]
        await a.connect(f"/ip4/127.0.0.1/tcp/{proxy_port}/p2p/{b.peer_id}")
        assert await a.ping(b.peer_id) > 0
        frozen.set()
        with trio.fail_after(15):
            while b.peer_id in a.peers():
                await trio.sleep(0.1)
        assert a.keepalive_closed >= 1
        nursery.cancel_scope.cancel()
