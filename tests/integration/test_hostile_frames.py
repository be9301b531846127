"""Activation frames where they do not belong: replayed, reordered, reflected, or answering the
wrong step. Real hosts on loopback; the hostile hops speak the activation protocol themselves.

Each stream carries one session, and frames flow one way on it: steps down the chain, results
on the return stream, errors (only) back up. A frame breaking that ends the session with an error
naming the peer that sent it."""

import time
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
from shardnet.protocols.block_claim import Claim
from shardnet.transport import open_node
from shardnet.transport.config import peer_info


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_random(tmp_path_factory.mktemp("hostile") / "m", "llama", layers=4, hidden=32, heads=2,
                       kv_heads=1, vocab=128, seed=5)


def claim_of(node, model_id, start, end):
    return Claim(model=model_id, start=start, end=end, kv_tokens=4096, tput=100.0,
                 addrs=tuple(str(a) for a in node.listen_addrs), expires=time.time() + 300, peer=str(node.peer_id))


def serve_hostile_last_hop(node, misbehave):
    """A last hop that attaches to the client properly, then lets ``misbehave(up, ret, step)``
    answer the first step."""

    async def handle(stream):
        up = MessageStream(stream)
        op = await up.recv(10)
        await node.connect(peer_info(op.ret.peer, list(op.ret.addrs)))
        ret = MessageStream(await node.new_stream(op.ret.peer, ap.PROTOCOL_ID))
        await ret.send(ap.Attach(op.session))
        await up.send(ap.Ready(op.session))
        step = await up.recv(10)
        await misbehave(up, ret, step)
        await trio.sleep(5)  # hold the streams open: the client must notice by itself

    node.set_stream_handler(ap.PROTOCOL_ID, handle)


def result_for(step, **changes):
    f = {"n": step.n, "pos": step.pos, "dtype": step.dtype, "shape": step.shape, **changes}
    return ap.Result(step.session, n=f["n"], pos=f["pos"], dtype=f["dtype"], shape=f["shape"], payload=step.payload)


async def twice(up, ret, step):
    await ret.send(result_for(step))
    await ret.send(result_for(step))  # replayed


async def skewed(up, ret, step):
    await ret.send(result_for(step, pos=step.pos + 1))


async def reflect(up, ret, step):
    await up.send(step)  # the client's own frame, sent back the way it came


@pytest.mark.parametrize("misbehave,pattern", [
    (twice, r"result 0 answers no step in flight"),
    (skewed, r"result 0 is for position 1; step 0 started at 0"),
    (reflect, r"the first hop sent step upstream"),
])
async def test_client_refuses_frames_that_answer_no_step(loopback_config, model_path, misbehave, pattern):
    model = LocalModel(model_path)
    async with open_node(loopback_config()) as hostile, open_node(loopback_config()) as node:
        serve_hostile_last_hop(hostile, misbehave)
        client = Client(node, model, route=[claim_of(hostile, model.model_id, 0, 4)])
        x = model.head.embed(torch.tensor([[1, 2, 3]]))
        with trio.fail_after(30):
            async with client.session(16) as sess:
                with pytest.raises(InferenceError, match=pattern) as err:
                    await sess.forward(x)
                    await sess.forward(x[:, :1])
    assert err.value.peer == str(hostile.peer_id)


async def test_a_hop_refuses_frames_its_next_hop_reflects(loopback_config, model_path):
    """An honest first hop whose next hop sends its step back upstream ends the session and names
    that peer to the client."""
    model = LocalModel(model_path)
    async with AsyncExitStack() as stack:
        honest = await stack.enter_async_context(open_node(loopback_config()))
        await stack.enter_async_context(serve_block(honest, str(model_path), 0, 2))
        hostile = await stack.enter_async_context(open_node(loopback_config()))
        serve_hostile_last_hop(hostile, reflect)
        node = await stack.enter_async_context(open_node(loopback_config()))
        await node.connect(f"{honest.listen_addrs[0]}/p2p/{honest.peer_id}")
        route = [*await fetch_claims(node, str(honest.peer_id)), claim_of(hostile, model.model_id, 2, 4)]
        client = Client(node, model, route=route)
        with trio.fail_after(30):
            async with client.session(16) as sess:
                with pytest.raises(InferenceError, match="the next hop sent step upstream") as err:
                    await sess.forward(model.head.embed(torch.tensor([[1, 2, 3]])))
    assert err.value.peer == str(hostile.peer_id)


@pytest.mark.parametrize("n,pos,pattern", [
    (0, 3, r"step_order: step 0 arrived after step 0"),    # replayed
    (5, 9, r"position: step starts at position 9, past the 3"),  # a gap in the positions
])
async def test_a_peer_refuses_replayed_and_out_of_place_steps(loopback_config, model_path, n, pos, pattern):
    model = LocalModel(model_path)
    async with AsyncExitStack() as stack:
        peer = await stack.enter_async_context(open_node(loopback_config()))
        served = await stack.enter_async_context(serve_block(peer, str(model_path), 0, 4))
        node = await stack.enter_async_context(open_node(loopback_config()))
        await node.connect(f"{peer.listen_addrs[0]}/p2p/{peer.peer_id}")
        client = Client(node, model, route=await fetch_claims(node, str(peer.peer_id)))
        x = model.head.embed(torch.tensor([[1, 2, 3]]))
        with trio.fail_after(30):
            async with client.session(16) as sess:
                await sess.forward(x)
                dtype, shape, payload = "float32", [1, 1, 32], bytes(4 * 32)
                await sess.up.send(ap.Step(sess.session, n=n, pos=pos, dtype=dtype, shape=shape, payload=payload))
                with pytest.raises(InferenceError, match=pattern):
                    await sess.receive()
        assert served.kv.used == 0  # the refused session gave its KV cache back
