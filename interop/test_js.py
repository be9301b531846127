"""shardnet against js-libp2p (interop/js/peer.js, a separate Node.js process): TCP + Noise +
Yamux both ways, identify, ping, a shardnet protocol stream echoed byte for byte, gossipsub."""

import base64
import functools

import trio
from libp2p.peer.id import ID

from foreign import ForeignError
from shardnet.protocols import activation as ap
from shardnet.protocols import echo
from shardnet.transport import ShardnetError, open_node

TOPIC = "interop/news"


async def call(js, cmd, **kw):
    """The js peer's command, from a worker thread: the trio loop must keep serving meanwhile."""
    return await trio.to_thread.run_sync(functools.partial(js.call, cmd, **kw))


def step_frame() -> bytes:
    payload = bytes(range(256)) * 8  # [1, 4, 128] float32 = 2048 bytes
    msg = ap.tensor_msg("step", b"\x07" * ap.SESSION_ID_BYTES, n=3, pos=11, dtype="float32", shape=[1, 4, 128],
                        payload=payload, logits_for=2, epoch=1)
    return ap.encode(msg)


async def test_shardnet_dials_js_and_both_identify(js, node_config):
    async with open_node(node_config()) as node:
        observed = _record_observations(node)
        await node.connect(js.addrs[0])
        assert node.link(js.peer_id) == "direct"
        with trio.fail_after(10):  # identify runs right after the connection
            while "/ipfs/ping/1.0.0" not in _protocols(node, js.peer_id):
                await trio.sleep(0.1)
        assert {"/ipfs/id/1.0.0", ap.PROTOCOL_ID, "/meshsub/1.1.0"} <= set(_protocols(node, js.peer_id))
        info = await call(js, "peer_info", peer=str(node.peer_id))
        assert "/ipfs/id/1.0.0" in info["protocols"] and "/ipfs/kad/1.0.0" in info["protocols"]
        assert info["agent"] and "py-libp2p" in info["agent"], info
        assert any(a.startswith("/ip4/127.0.0.1/tcp/") for a in info["addrs"])
        # what js observed of us, through identify, is a valid address: our IP and the port we dialled from
        with trio.fail_after(10):
            while not observed:
                await trio.sleep(0.1)
        conns = (await call(js, "conns"))["conns"]
        seen_by_js = [c["remote"] for c in conns if c["peer"] == str(node.peer_id)]
        assert observed[0].split("/p2p/")[0] in [a.split("/p2p/")[0] for a in seen_by_js], (observed, seen_by_js)


async def test_js_dials_shardnet_and_pings_go_both_ways(js, node_config):
    async with open_node(node_config()) as node:
        r = await call(js, "dial", addr=str(node.listen_addrs[0]))  # (listen addresses end in /p2p/<us>)
        assert r["peer"] == str(node.peer_id)
        rtt = await node.ping(js.peer_id)
        assert 0 < rtt < 5
        r = await call(js, "ping", peer=str(node.peer_id))
        assert 0 <= r["rtt_ms"] < 5000


async def test_an_activation_frame_is_echoed_byte_for_byte_both_ways(js, node_config):
    frame = step_frame()
    async with open_node(node_config()) as node:
        # shardnet -> js: a stream of shardnet's activation protocol, echoed by js-libp2p
        await node.connect(js.addrs[0])
        async with await node.new_stream(js.peer_id, ap.PROTOCOL_ID) as s:
            await s.write(frame)
            back = await s.read_exactly(len(frame), timeout=10)
        assert back == frame
        [msg] = ap.ActivationDecoder().feed(back)
        assert (msg.type, msg["n"], msg["pos"], msg["shape"], msg.get("e")) == ("step", 3, 11, [1, 4, 128], 1)
        # js -> shardnet: the same frame on shardnet's echo protocol (its framing is the same u32 prefix)
        node.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        r = await call(js, "echo", addr=str(node.listen_addrs[0]), protocol=echo.PROTOCOL_ID,
                       data=base64.b64encode(frame).decode())
        assert base64.b64decode(r["data"]) == frame


async def test_gossipsub_messages_flow_both_ways(js, node_config):
    async with open_node(node_config()) as node, node.pubsub.subscribe(TOPIC) as sub:
        await call(js, "subscribe", topic=TOPIC)
        await node.connect(js.addrs[0])
        with trio.fail_after(20):  # both sides see the other in the topic (heartbeats form the mesh)
            while js.peer_id not in [str(p) for p in node.pubsub.topic_peers(TOPIC)] or \
                    str(node.peer_id) not in (await call(js, "topic_peers", topic=TOPIC))["peers"]:
                await trio.sleep(0.3)
        await trio.sleep(1.5)
        await node.pubsub.publish(TOPIC, b"from shardnet")
        got = await trio.to_thread.run_sync(js.wait_message, TOPIC, 20)
        assert got == b"from shardnet"
        r = await call(js, "publish", topic=TOPIC, data=base64.b64encode(b"from js").decode())
        assert str(node.peer_id) in r["recipients"]
        msg = await sub.receive(timeout=20)
        while msg.sender == node.peer_id:  # our own post comes back to us too
            msg = await sub.receive(timeout=20)
        assert msg.data == b"from js" and str(msg.sender) == js.peer_id


async def test_dht_values_and_provider_records_cross_implementations(js, node_config):
    from shardnet.transport import identity, records
    from shardnet.transport.dht import provider_key

    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    async with open_node(node_config()) as node:
        await node.connect(js.addrs[0])
        await trio.sleep(1)  # identify tells each side the other speaks /ipfs/kad/1.0.0
        # a signed record shardnet puts is stored by js (its PUT_VALUE accepted) and found by js's get
        key = await node.dht.put("interop/profile", b"from shardnet")
        r = await _until(lambda: call(js, "dht_get", key=b64(key.encode()), seconds=5), lambda r: r["values"])
        assert r["values"], r
        assert records.decode(key, base64.b64decode(r["values"][0]["value"])).data == b"from shardnet"
        # a record js puts (shardnet's format, signed by a third identity) passes shardnet's validator
        kp = identity.generate()
        publisher = ID.from_pubkey(kp.public_key)
        key = records.record_key(publisher, "interop/note")
        r = await call(js, "dht_put", key=b64(key.encode()), value=b64(records.encode(kp, "interop/note", b"via js")))
        assert r["responses"] >= 1
        assert node.dht.kad.value_store.get(key.encode()) is not None  # stored here by js's PUT_VALUE
        assert await node.dht.get(publisher, "interop/note") == b"via js"
        # GET_VALUE both ways: each side fetches a record only the other one holds
        node.dht.kad.value_store.remove(key.encode())
        assert await node.dht.get(publisher, "interop/note") == b"via js"  # from js
        key = records.record_key(node.peer_id, "interop/local")
        node.dht.kad.value_store.put(key.encode(), records.encode(node.dht._key_pair(), "interop/local", b"only here"))
        r = await _until(lambda: call(js, "dht_get", key=b64(key.encode()), seconds=5), lambda r: r["values"])
        assert [v["from"] for v in r["values"]] == [str(node.peer_id)], r
        assert records.decode(key, base64.b64decode(r["values"][0]["value"])).data == b"only here"
        # provider records: shardnet's keys are multihashes, so a CID names them in js
        await node.dht.provide("interop/room")
        r = await _until(lambda: call(js, "find_providers", multihash=provider_key("interop/room")),
                         lambda r: str(node.peer_id) in [p["peer"] for p in r["providers"]])
        assert str(node.peer_id) in [p["peer"] for p in r["providers"]], r
        await call(js, "provide", multihash=provider_key("interop/js-room"))
        found = await node.dht.find_providers("interop/js-room")
        assert js.peer_id in [str(p.peer_id) for p in found], found


async def test_a_shardnet_peer_reserves_on_a_js_relay_and_is_dialled_through_it(js_relay, node_config):
    from shardnet.transport.config import parse_peer_addr

    async with open_node(node_config(auto_relays=0)) as a, open_node(node_config(auto_relays=0)) as b:
        a.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        rsvp = await a.relay_client.reserve(parse_peer_addr(js_relay.addrs[0]))
        assert rsvp.expire > 0
        circuit = f"{js_relay.addrs[0]}/p2p-circuit/p2p/{a.peer_id}"
        assert circuit in [str(x) for x in a.listen_addrs]  # advertised next to the direct ones
        assert await b.connect(circuit) == a.peer_id
        assert [c["relayed"] for c in b.connections(a.peer_id)] == [True]
        frame = step_frame()  # an activation frame, echoed end to end through the js relay
        async with await b.new_stream(a.peer_id, echo.PROTOCOL_ID) as s:
            for _ in range(8):
                await s.write(frame)
                assert await s.read_exactly(len(frame), timeout=10) == frame
        # js relays limit each circuit (128 KiB by default): past it the circuit ends, and the
        # stream fails with an error at once instead of hanging
        echoed = 0
        with trio.fail_after(20):
            try:
                async with await b.new_stream(a.peer_id, echo.PROTOCOL_ID) as s:
                    for _ in range(200):
                        await s.write(frame)
                        await s.read_exactly(len(frame), timeout=10)
                        echoed += len(frame)
            except ShardnetError as e:
                assert "ended" in str(e) or "closed" in str(e) or "reset" in str(e), e
        assert 0 < echoed < 200 * len(frame)


async def _until(ask, ok, within: float = 20.0):
    """``ask()``'s answer once ``ok`` accepts it (right after connecting, DHT routing tables may
    not hold the other side yet), or the last answer when time is up."""
    deadline = trio.current_time() + within
    while True:
        try:
            got = await ask()
            if ok(got) or trio.current_time() > deadline:
                return got
        except ForeignError:
            if trio.current_time() > deadline:
                raise
        await trio.sleep(0.5)


def _record_observations(node) -> list[str]:
    """The addresses peers report seeing us at (identify's observedAddr), as they arrive."""
    seen: list[str] = []
    manager = node.host._observed_addr_manager
    record = manager.record_observation

    def spy(conn, observed, local_addrs):
        seen.append(str(observed))
        return record(conn, observed, local_addrs)

    manager.record_observation = spy
    return seen


def _protocols(node, peer):
    try:
        return node.host.get_peerstore().get_protocols(ID.from_base58(peer))
    except Exception:
        return []
