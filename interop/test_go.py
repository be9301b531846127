"""shardnet against go-libp2p v0.32.1 (p2pd, a separate process driven over its control socket):
TCP + Noise + Yamux both ways, identify, a shardnet protocol stream echoed byte for byte,
gossipsub both ways, DHT values and providers. p2pd's stream bridge handles half-close poorly, so
every payload is length-framed (the activation protocol's own u32 prefix)."""

import pytest
import trio
from libp2p.peer.id import ID

from shardnet.protocols import activation as ap
from shardnet.protocols import echo
from shardnet.transport import open_node

from checks import circuit_through, echoed_frame, protocols_of, record_observations, step_frame, until
from p2pd import P2pdError

TOPIC = "interop/news"


async def test_shardnet_dials_go_and_both_identify(go, node_config):
    async with open_node(node_config()) as node:
        observed = record_observations(node)
        await node.connect(go.addrs[0])
        assert node.link(go.peer_id) == "direct"
        with trio.fail_after(10):
            while "/ipfs/id/1.0.0" not in protocols_of(node, go.peer_id):
                await trio.sleep(0.1)
        assert {"/ipfs/ping/1.0.0", "/meshsub/1.1.0", "/ipfs/kad/1.0.0"} <= set(protocols_of(node, go.peer_id))
        with trio.fail_after(10):
            while not observed:
                await trio.sleep(0.1)
        assert observed[0].startswith("/ip4/127.0.0.1/tcp/"), observed
        rtt = await node.ping(go.peer_id)
        assert 0 < rtt < 5


async def test_go_dials_shardnet(go, node_config):
    async with open_node(node_config()) as node:
        await go.connect(str(node.listen_addrs[0]))
        with trio.fail_after(10):
            while ID.from_base58(go.peer_id) not in node.peers():
                await trio.sleep(0.1)
        assert await node.ping(go.peer_id) > 0


async def test_an_activation_frame_is_echoed_byte_for_byte_both_ways(go, node_config, tmp_path):
    frame = step_frame()

    async def go_echo(conn, info):  # go's side of /shardnet/activation/1.0.0: one framed message back
        n = int.from_bytes(await conn.read_exactly(4), "big")
        await conn.stream.send_all(n.to_bytes(4, "big") + await conn.read_exactly(n))

    async with open_node(node_config()) as node, trio.open_nursery() as nursery:
        await go.serve_protocol(ap.PROTOCOL_ID, go_echo, nursery, tmp_path / "handler.sock")
        await node.connect(go.addrs[0])
        msg = await echoed_frame(node, go.peer_id, frame)
        assert (msg.type, msg.n, list(msg.shape)) == ("step", 3, [1, 4, 128])
        # go -> shardnet, on shardnet's echo protocol
        node.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        conn = await go.stream_open(str(node.peer_id), echo.PROTOCOL_ID)
        async with conn.stream:
            await conn.stream.send_all(frame)
            with trio.fail_after(10):
                assert await conn.read_exactly(len(frame)) == frame
        nursery.cancel_scope.cancel()


async def test_gossipsub_messages_flow_both_ways(go, node_config):
    async with open_node(node_config()) as node, node.pubsub.subscribe(TOPIC) as sub:
        go_sub = await go.subscribe(TOPIC)
        await node.connect(go.addrs[0])
        with trio.fail_after(20):
            while go.peer_id not in [str(p) for p in node.pubsub.topic_peers(TOPIC)] or \
                    str(node.peer_id) not in await go.topic_peers(TOPIC):
                await trio.sleep(0.3)
        await trio.sleep(1.5)
        await node.pubsub.publish(TOPIC, b"from shardnet")
        with trio.fail_after(20):
            m = await go_sub.read_msg(go.pb.PSMessage)
        assert m.data == b"from shardnet" and str(ID(getattr(m, "from"))) == str(node.peer_id)
        await go.publish(TOPIC, b"from go")
        msg = await sub.receive(timeout=20)
        while msg.sender == node.peer_id:
            msg = await sub.receive(timeout=20)
        assert msg.data == b"from go" and str(msg.sender) == go.peer_id
        await go_sub.stream.aclose()


async def test_dht_values_and_provider_records_cross_implementations(go, node_config):
    from shardnet.transport import identity, records
    from shardnet.transport.dht import provider_key

    async with open_node(node_config()) as node:
        await node.connect(go.addrs[0])
        await trio.sleep(1)
        # go-libp2p's DHT stores and returns records only in namespaces it has a validator for
        # ("pk", "ipns"), and p2pd cannot register more, so shardnet's /shardnet/ records stay off
        # go nodes (docs/interop-notes.md). Values cross in the namespace both validate: "pk".
        # GET_VALUE: go fetches a public-key record that only shardnet holds
        kp = identity.generate()
        pid = ID.from_pubkey(kp.public_key)
        node.dht.kad.value_store.put(b"/pk/" + pid.to_bytes(), kp.public_key.serialize())
        got = await until(lambda: go.dht("GET_VALUE", key=b"/pk/" + pid.to_bytes()), retry_on=(P2pdError,))
        assert got[0].value == kp.public_key.serialize()
        # and a shardnet record is refused by go, as its validator rules say
        key = records.record_key(node.peer_id, "interop/note")
        with pytest.raises(P2pdError):
            await go.dht("PUT_VALUE", key=key.encode(), value=records.encode(node.dht._key_pair(), "interop/note", b"x"))
        # providers both ways (go names them by CID; shardnet's keys are multihashes)
        await node.dht.provide("interop/room")
        found = await until(lambda: go.dht("FIND_PROVIDERS", cid=_cid(provider_key("interop/room")), count=1),
                            lambda f: str(node.peer_id) in [str(ID(d.peer.id)) for d in f], retry_on=(P2pdError,))
        assert str(node.peer_id) in [str(ID(d.peer.id)) for d in found], found
        # (p2pd's PROVIDE call does not return on a two-node network, though its ADD_PROVIDER
        # arrives at once: bounded here, and the record is looked for where it matters)
        with trio.move_on_after(8):
            await go.dht("PROVIDE", cid=_cid(provider_key("interop/go-room")), seconds=5)
        found = await node.dht.find_providers("interop/go-room")
        assert go.peer_id in [str(p.peer_id) for p in found], found


def _cid(multihash_hex: str) -> bytes:
    """CIDv1, raw codec, of a multihash: what go's DHT request names content by."""
    return b"\x01\x55" + bytes.fromhex(multihash_hex)


@pytest.mark.xfail(strict=True, reason="py-libp2p 0.8.1 decodes DHT keys as UTF-8 in its PUT_VALUE handler, so "
                   "binary keys such as /pk/<peer ID bytes> are refused unanswered (docs/interop-notes.md)")
async def test_a_value_go_puts_under_a_binary_key_is_stored_by_shardnet(go, node_config):
    from shardnet.transport import identity

    async with open_node(node_config()) as node:
        await node.connect(go.addrs[0])
        await trio.sleep(1)
        kp = identity.generate()
        key = b"/pk/" + ID.from_pubkey(kp.public_key).to_bytes()
        with trio.move_on_after(15):
            await go.dht("PUT_VALUE", key=key, value=kp.public_key.serialize(), seconds=10)
        stored = node.dht.kad.value_store.get(key)
        assert stored is not None and stored.value == kp.public_key.serialize()


async def test_a_shardnet_peer_reserves_on_a_go_relay_and_is_dialled_through_it(go, node_config):
    async with circuit_through(go.addrs[0], node_config):
        pass  # the whole check (go's 4 GiB per-circuit limit leaves nothing to probe beyond it)
