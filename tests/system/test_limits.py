"""Resource limits: each one set low, exceeded by a real peer over loopback, answered with a reset
or an error reply while the node goes on serving everyone else."""

import subprocess
import sys
from contextlib import AsyncExitStack

import pytest
import torch
import trio

from shardnet.errors import InferenceError
from shardnet.inference.claims import fetch_claims
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.inference.server.compute_peer import serve_block
from shardnet.protocols import activation as ap
from shardnet.protocols.activation_io import MessageStream
from shardnet.testing.factories import echo_handler
from shardnet.transport import open_node
from shardnet.transport.errors import ShardnetError
from shardnet.transport.limits import LimitError, Limits, TokenBuckets


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_random(tmp_path_factory.mktemp("limits") / "m", "llama", layers=2, hidden=32, heads=2,
                       kv_heads=1, vocab=128, seed=6)


def limits(**kw):
    lim = Limits()
    for k, v in kw.items():
        lim.set(f"{k}={v}")
    return lim


# -- the pieces ------------------------------------------------------------------------------------
def test_limits_are_set_by_name_and_checked():
    lim = limits(sessions_per_peer=3, session_idle_s=1.5)
    assert (lim.sessions_per_peer, lim.session_idle_s) == (3, 1.5)
    for bad, why in [("nope=1", "unknown limit"), ("sessions_per_peer", "NAME=VALUE"),
                     ("sessions_per_peer=2.5", "an integer"), ("session_idle_s=-1", "positive")]:
        with pytest.raises(LimitError, match=why):
            lim.set(bad)
    assert [name for name, _, doc in Limits.describe() if not doc] == []
    out = subprocess.run([sys.executable, "-m", "shardnet", "limits"], capture_output=True, text=True).stdout
    assert all(name in out for name, _, _ in Limits.describe())


def test_token_buckets_refill_and_stay_bounded():
    b = TokenBuckets(rate=2.0, burst=3, max_keys=100)
    assert [b.take("p", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert b.take("p", now=0.5) and not b.take("p", now=0.5)  # one token per 0.5 s
    assert b.take("q", now=0.5)  # others have their own bucket
    for i in range(10_000):  # a flood of new keys (peer IDs) keeps the table bounded
        b.take(i, now=1.0 + i * 1e-4)
    assert len(b._buckets) <= 100


# -- against real peers ----------------------------------------------------------------------------
async def test_streams_per_peer_and_stream_rate(loopback_config):
    async def hold(stream):
        await trio.sleep(5)

    async with open_node(loopback_config(limits=limits(streams_per_peer=20, stream_burst_per_peer=1000))) as victim, \
            open_node(loopback_config()) as greedy, open_node(loopback_config()) as other:
        victim.set_stream_handler("/t/hold", hold)
        victim.set_stream_handler("/t/echo", echo_handler)
        await greedy.connect(f"{victim.listen_addrs[0]}/p2p/{victim.peer_id}")
        opened, refused = [], 0
        for _ in range(40):
            try:
                opened.append(await greedy.new_stream(victim.peer_id, "/t/hold", timeout=5))
            except ShardnetError:
                refused += 1
        # the cap counts every stream of the peer (identify and DHT ones too, now and then)
        assert 16 <= len(opened) <= 20 and refused == 40 - len(opened), (len(opened), refused)
        assert victim.host.get_network().stream_gate.open[greedy.peer_id] == 20
        # another peer is not affected
        await other.connect(f"{victim.listen_addrs[0]}/p2p/{victim.peer_id}")
        s = await other.new_stream(victim.peer_id, "/t/echo")
        await s.write(b"hi")
        assert await s.read_some(timeout=5) == b"hi"

    async with open_node(loopback_config(limits=limits(stream_rate_per_peer=5, stream_burst_per_peer=10))) as victim, \
            open_node(loopback_config()) as greedy:
        victim.set_stream_handler("/t/echo", echo_handler)
        await greedy.connect(f"{victim.listen_addrs[0]}/p2p/{victim.peer_id}")
        await trio.sleep(2.5)  # identify and DHT streams of a new connection count too: let the bucket refill
        ok = 0
        for _ in range(30):
            try:
                s = await greedy.new_stream(victim.peer_id, "/t/echo", timeout=5)
                await s.close()
                ok += 1
            except ShardnetError:
                pass
        assert 8 <= ok <= 14, ok  # the burst, plus what refilled during the loop
        assert victim.host.get_network().stream_gate.refusals.counts["stream_rate_per_peer"] >= 30 - ok


async def test_dht_records_per_peer_and_in_all(loopback_config):
    lim = limits(dht_records_per_peer=5, dht_records=8)
    async with open_node(loopback_config(limits=lim)) as victim, open_node(loopback_config()) as a, \
            open_node(loopback_config()) as b:
        for n in (a, b):
            await n.connect(f"{victim.listen_addrs[0]}/p2p/{victim.peer_id}")
            await n.dht.add_peer(victim.peer_id)
        store = victim.dht.kad.value_store.store
        for i in range(10):
            await a.dht.put(f"name-{i}", b"x" * 100)
        assert len(store) == 5
        await a.dht.put("name-0", b"refreshed")  # replacing a stored value is always allowed
        for i in range(10):
            await b.dht.put(f"other-{i}", b"y")
        assert len(store) == 8
        assert await b.dht.get(a.peer_id, "name-0") == b"refreshed"


async def test_session_limits_answer_with_errors(loopback_config, model_path):
    model = LocalModel(model_path)
    lim = limits(sessions_per_peer=2, session_rate_per_peer=0.1, session_burst_per_peer=2)
    async with AsyncExitStack() as stack:
        peer = await stack.enter_async_context(open_node(loopback_config(limits=lim)))
        await stack.enter_async_context(serve_block(peer, str(model_path), 0, 2))
        clients = []
        for _ in range(2):
            node = await stack.enter_async_context(open_node(loopback_config()))
            await node.connect(f"{peer.listen_addrs[0]}/p2p/{peer.peer_id}")
            # (a refused open waits in line and tries again up to queue_timeout, then fails naming the refusal)
            clients.append(Client(node, model, route=await fetch_claims(node, str(peer.peer_id)), queue_timeout=1.0))
        greedy, modest = clients
        x = model.head.embed(torch.tensor([[1, 2]]))
        async with greedy.session(8) as s1, greedy.session(8) as s2:
            await s1.forward(x)
            await s2.forward(x)
            with pytest.raises(InferenceError, match="too_many_sessions"):
                async with greedy.session(8):
                    pass
            async with modest.session(8) as s:  # another peer still gets in
                await s.forward(x)
        # two opens spent the burst of two (the refused one took nothing); the next is refused
        with pytest.raises(InferenceError, match="rate_limited"):
            async with greedy.session(8):
                pass


async def test_frame_size_and_first_frame_limits(loopback_config, model_path):
    lim = limits(activation_frame_bytes=4096, first_frame_s=0.5)
    async with AsyncExitStack() as stack:
        peer = await stack.enter_async_context(open_node(loopback_config(limits=lim)))
        await stack.enter_async_context(serve_block(peer, str(model_path), 0, 2))
        node = await stack.enter_async_context(open_node(loopback_config()))
        await node.connect(f"{peer.listen_addrs[0]}/p2p/{peer.peer_id}")
        # a slow first frame: the stream gets an error within first_frame_s, not after 30 s
        ms = MessageStream(await node.new_stream(str(peer.peer_id), ap.PROTOCOL_ID))
        await ms.stream.write(b"\x00\x00")  # half a length prefix, then nothing
        with trio.fail_after(5):
            reply = await ms.recv(5)
        assert reply.type == "error" and reply.code == "timeout", reply
        # a frame declaring more than the limit: refused from its length prefix
        ms = MessageStream(await node.new_stream(str(peer.peer_id), ap.PROTOCOL_ID))
        await ms.stream.write((1 << 20).to_bytes(4, "big") + b"\0" * 64)
        reply = await ms.recv(5)
        assert reply.type == "error" and reply.code == "too_large", reply


async def test_dht_requests_per_peer(loopback_config):
    """Requests pipelined on one stream count one by one; streams per peer are capped too."""
    from libp2p.kad_dht.pb.kademlia_pb2 import Message
    from libp2p.utils.varint import (
        encode_varint_prefixed,
        read_varint_prefixed_bytes_limited,
    )

    lim = limits(dht_requests_per_peer=0.5, dht_burst_per_peer=5, dht_streams_per_peer=2)
    async with open_node(loopback_config(limits=lim)) as victim, open_node(loopback_config()) as peer:
        await peer.connect(f"{victim.listen_addrs[0]}/p2p/{victim.peer_id}")
        req = Message()
        req.type = Message.MessageType.FIND_NODE
        req.key = peer.peer_id.to_bytes()
        s = await peer.new_stream(victim.peer_id, "/ipfs/kad/1.0.0")
        await s.write(encode_varint_prefixed(req.SerializeToString()) * 20)
        answered = 0
        with trio.move_on_after(5):
            try:
                while True:
                    await read_varint_prefixed_bytes_limited(s.raw, 1 << 20)
                    answered += 1
            except Exception:
                pass
        assert 1 <= answered <= 5, answered  # the burst (the peer's own lookups may have taken some)
        held = [await peer.new_stream(victim.peer_id, "/ipfs/kad/1.0.0") for _ in range(3)]
        await held[-1].write(encode_varint_prefixed(req.SerializeToString()))
        try:
            got = await held[-1].read_some(timeout=5)
        except ShardnetError:
            got = b""
        assert got == b""  # the third stream at once was reset
