"""The activation protocol: codec properties, and a real peer answering bad input."""

import os
import struct

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.inference.router import ActivationRouter
from shardnet.inference.server.compute_peer import serve_block
from shardnet.protocols import activation as ap
from shardnet.protocols.activation_io import MessageStream
from shardnet.testing.factories import activation_frame
from shardnet.transport import open_node

SID = b"s" * 16


def test_roundtrip_of_every_message_type():
    msgs = [
        ap.Open(SID, model="ab" * 32, layers=(0, 4), max_len=64,
                chain=[ap.Hop("12D3KooWpeer", ["/ip4/127.0.0.1/tcp/1"], (4, 8))],
                ret=ap.PeerRef("12D3KooWme", []), logits=True),
        ap.Ready(SID), ap.Attach(SID), ap.Close(SID),
        ap.Step(SID, n=3, pos=10, dtype="float16", shape=[1, 2, 3], payload=bytes(12)),
        ap.Result(SID, n=3, pos=10, dtype="float32", shape=[1, 1, 5], payload=bytes(20), kind="logits"),
        ap.Error(SID, "shape", "bad", n=2),
        ap.Error(SID, "next_hop", "next hop closed the stream", peer="12D3KooWpeer"),
    ]
    dec = ap.ActivationDecoder()
    wire = b"".join(ap.encode(m) for m in msgs)
    got = []
    for i in range(0, len(wire), 7):  # arbitrary chunking
        got += dec.feed(wire[i:i + 7])
    assert [(m.type, m.session, m.fields, m.payload) for m in got] == \
           [(m.type, m.session, m.fields, m.payload) for m in msgs]


@pytest.mark.parametrize("header,payload,code", [
    ({"v": 2, "t": "ready", "s": SID}, b"", "version"),
    ({"v": 1, "t": "teleport", "s": SID}, b"", "unknown_type"),
    ({"v": 1, "t": "ready", "s": b"short"}, b"", "malformed"),
    ({"v": 1, "t": "step", "s": SID, "n": 0, "pos": 0, "dtype": "int8", "shape": [1, 1, 4]}, bytes(4), "dtype"),
    ({"v": 1, "t": "step", "s": SID, "n": 0, "pos": 0, "dtype": "float32", "shape": [1, 1, 4]}, bytes(15), "shape"),
    ({"v": 1, "t": "step", "s": SID, "n": -1, "pos": 0, "dtype": "float32", "shape": [1]}, bytes(4), "malformed"),
    ({"v": 1, "t": "step", "s": SID, "n": True, "pos": 0, "dtype": "float32", "shape": [1]}, bytes(4), "malformed"),
    ({"v": 1, "t": "open", "s": SID, "model": "zz", "layers": [0, 1], "max_len": 1, "chain": [],
      "ret": {"peer": "p", "addrs": []}}, b"", "malformed"),
    ({"v": 1, "t": "open", "s": SID, "model": "ab" * 32, "layers": [3, 1], "max_len": 1, "chain": [],
      "ret": {"peer": "p", "addrs": []}}, b"", "malformed"),
    ({"v": 1, "t": "ready", "s": SID}, b"extra", "malformed"),
    ({"v": 1, "t": "error", "s": SID, "code": "next_hop", "msg": "x", "peer": 7}, b"", "malformed"),
])
def test_bad_frames_are_named(header, payload, code):
    with pytest.raises(ap.ActivationProtocolError) as e:
        ap.ActivationDecoder().feed(activation_frame(header, payload))
    assert e.value.code == code


def test_huge_declared_length_is_refused_before_buffering():
    dec = ap.ActivationDecoder(max_frame=1 << 20)
    with pytest.raises(ap.ActivationProtocolError) as e:
        dec.feed(struct.pack(">I", 0xFFFFFFF0))
    assert e.value.code == "too_large"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_raise_only_protocol_errors(data):
    try:
        ap.ActivationDecoder(max_frame=4096).feed(data)
    except ap.ActivationProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "t", "s", "n", "pos", "dtype", "shape", "model", "layers",
                                        "max_len", "chain", "ret", "code", "msg", "kind", "logits"]),
                       st.one_of(st.integers(-3, 3), st.text(max_size=5), st.binary(max_size=17),
                                 st.booleans(), st.none(), st.lists(st.integers(-1, 4), max_size=4)),
                       max_size=10),
       st.binary(max_size=64))
def test_arbitrary_headers_raise_only_protocol_errors(header, payload):
    try:
        ap.ActivationDecoder().feed(activation_frame(header, payload))
    except ap.ActivationProtocolError:
        pass


# -- a real peer ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_random(tmp_path_factory.mktemp("m") / "llama", "llama", layers=2, hidden=32, heads=2,
                       kv_heads=1, vocab=300, seed=5)


async def test_bad_input_gets_an_error_reply_and_the_peer_keeps_serving(loopback_config, model_dir):
    from shardnet.inference.model.checkpoint import Checkpoint

    model_id = Checkpoint(model_dir).model_id
    async with open_node(loopback_config()) as peer, open_node(loopback_config()) as cli:
        async with serve_block(peer, str(model_dir), 0, 2) as served:
            await cli.connect(peer.listen_addrs[0])
            ActivationRouter.of(cli)  # the client side accepts return streams (and refuses strangers')
            me = ap.PeerRef(str(cli.peer_id), [str(a) for a in cli.listen_addrs])

            def open_(**kw):
                args = dict(model=model_id, layers=(0, 2), max_len=16, chain=[], ret=me)
                args.update(kw)
                return ap.encode(ap.Open(os.urandom(16), **args))

            def step(sid, dtype="float32", hidden=32, n=0, pos=0, payload=None):
                shape = [1, 1, hidden]
                size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype] * hidden
                return ap.encode(ap.Step(sid, n=n, pos=pos, dtype=dtype, shape=shape,
                                               payload=payload if payload is not None else bytes(size)))

            async def exchange(*chunks, half_close=False):
                ms = MessageStream(await cli.new_stream(peer.peer_id, ap.PROTOCOL_ID))
                for c in chunks:
                    await ms.stream.write(c)
                if half_close:
                    await ms.stream.raw.close()
                replies = []
                with trio.fail_after(15):
                    while (m := await ms.recv(15)) is not None:
                        replies.append(m)
                        if m.type == "error":
                            break
                return replies

            async def expect_error(code, *chunks, **kw):
                replies = await exchange(*chunks, **kw)
                assert replies and replies[-1].type == "error", replies
                assert replies[-1].code == code, replies[-1].fields
                return replies[-1].msg

            # wrong model ID, layers out of range, wrong hidden size, wrong dtype, unknown session,
            # a step before open, a frame cut short, an unsupported version
            assert "serves model" in await expect_error("wrong_model", open_(model="cd" * 32))
            assert "0:2" in await expect_error("layers", open_(layers=(0, 5)))
            sid = os.urandom(16)
            assert "hidden size 48" in await expect_error(
                "hidden_size", ap.encode(ap.Open(sid, model=model_id, layers=(0, 2), max_len=16, chain=[],
                                                     ret=me)), step(sid, hidden=48))
            sid = os.urandom(16)
            assert "int64" in await expect_error(
                "dtype", ap.encode(ap.Open(sid, model=model_id, layers=(0, 2), max_len=16, chain=[],
                                               ret=me)),
                activation_frame({"v": 1, "t": "step", "s": sid, "n": 0, "pos": 0, "dtype": "int64",
                                  "shape": [1, 1, 32]}, bytes(256)))
            sid = os.urandom(16)
            await expect_error("unknown_session",
                               ap.encode(ap.Open(sid, model=model_id, layers=(0, 2), max_len=16, chain=[],
                                                     ret=me)), step(os.urandom(16)))
            await expect_error("unexpected", step(os.urandom(16)))
            sid = os.urandom(16)
            cut = step(sid)
            await expect_error("malformed", ap.encode(ap.Open(sid, model=model_id, layers=(0, 2), max_len=16,
                                                                  chain=[], ret=me)), cut[:len(cut) // 2],
                               half_close=True)
            await expect_error("version", activation_frame({"v": 9, "t": "open", "s": os.urandom(16)}))

            # after all that, the peer still serves a real generation
            client = Client(cli, LocalModel(model_dir))
            toks = [t async for t in client.generate([1, 2, 3], max_new_tokens=5, stop_at_eos=False)]
            assert len(toks) == 5
            assert served.kv.used == 0  # every failed session released its KV


async def test_a_session_whose_set_up_fails_gives_back_its_kv_and_slot(loopback_config, model_dir, monkeypatch):
    """Past admission (KV reserved, a session slot taken), a failure setting the session up
    (its receipt recorder here) gives both back: the peer's budget does not leak. (And a
    sub-span of a peer holding the LM head may ask for logits only where it ends at the model's
    last layer.)"""
    from shardnet.inference.model.checkpoint import Checkpoint
    from shardnet.inference.server import block_endpoint
    from shardnet.inference.server.compute_peer import join_swarm
    from shardnet.transport.stream import StreamClosedError

    def broken(*a, **kw):
        raise RuntimeError("recorder broke")

    model_id = Checkpoint(model_dir).model_id
    async with open_node(loopback_config()) as peer, open_node(loopback_config()) as cli:
        async with join_swarm(peer, str(model_dir), layers=(0, 2), rebalance_interval=0, hold_head=True) as compute:
            await cli.connect(peer.listen_addrs[0])
            me = ap.PeerRef(str(cli.peer_id), [str(a) for a in cli.listen_addrs])

            async def first_reply(layers, **kw):
                ms = MessageStream(await cli.new_stream(peer.peer_id, ap.PROTOCOL_ID))
                await ms.stream.write(ap.encode(ap.Open(os.urandom(16), model=model_id, layers=layers, max_len=16,
                                                        chain=[], ret=me, **kw)))
                with trio.fail_after(15):
                    try:
                        return await ms.recv(15)
                    except StreamClosedError:
                        return None

            reply = await first_reply((0, 1), logits=True)
            assert reply.code == "no_head" and "layers end at 1" in reply.msg
            monkeypatch.setattr(block_endpoint, "StageRecorder", broken)
            assert await first_reply((0, 2)) is None  # (the handler failed: the stream is reset)
            assert compute.served.kv.used == 0 and not compute.endpoint.sessions_by_peer
