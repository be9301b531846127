"""``/shardnet/weights/1.0.0`` without a network: chunk roots and checks, and the two sans-IO ends
of a stream fed bytes cut anywhere, pairing replies with requests, refusing what breaks a rule
with a one-line WeightsError."""

import hashlib
import os
import random

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardnet.errors import ShardnetError
from shardnet.protocols import weights as wp
from shardnet.protocols.framing import HEADER, encode_frame

MODEL = "ab" * 32
CS = wp.CHUNK_SIZE


def blob_of(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def hashes_of(data: bytes) -> bytes:
    return b"".join(wp.chunk_hash(data[a:b]) for a, b in
                    (wp.chunk_span(len(data), i) for i in range(wp.chunk_count(len(data)))))


def checker_for(name: str, data: bytes, with_hashes: bool = True) -> wp.ChunkChecker:
    h = hashes_of(data)
    return wp.ChunkChecker(name, len(data), wp.blob_root(len(data), h), h if with_hashes else None)


def chunks(data: bytes) -> list[bytes]:
    return [data[a:b] for a, b in (wp.chunk_span(len(data), i) for i in range(wp.chunk_count(len(data))))]


# -- roots and checks -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_blobs():
    return blob_of(2 * CS + 12345, 1), blob_of(2 * CS + 12345, 2)


def test_chunk_geometry():
    assert [wp.chunk_count(n) for n in (0, 1, CS - 1, CS, CS + 1, 3 * CS)] == [1, 1, 1, 1, 2, 3]
    assert wp.chunk_span(2 * CS + 5, 2) == (2 * CS, 2 * CS + 5)
    assert wp.chunk_span(0, 0) == (0, 0)


def test_root_commits_to_size_and_every_hash(two_blobs):
    a, _ = two_blobs
    h = hashes_of(a)
    root = wp.blob_root(len(a), h)
    assert len(root) == 64
    assert wp.blob_root(len(a) + 1, h) != root
    assert wp.blob_root(len(a), h[:-1] + bytes([h[-1] ^ 1])) != root
    assert wp.blob_root(len(a), h[32:64] + h[:32] + h[64:]) != root  # order matters


def test_every_chunk_of_a_blob_checks(two_blobs):
    a, _ = two_blobs
    c = checker_for("tensor:a", a)
    assert c.count == 3 and not c.needs_hashes
    for i, data in enumerate(chunks(a)):
        c.check(i, data)


def test_a_chunk_from_another_blob_is_bad(two_blobs):
    a, b = two_blobs
    c = checker_for("tensor:a", a)
    with pytest.raises(wp.BadChunk, match=r"^tensor:a: chunk 1 does not match its hash in the manifest$"):
        c.check(1, chunks(b)[1])
    with pytest.raises(wp.BadChunk, match="chunk 0 does not match"):
        c.check(0, chunks(a)[1])  # right blob, wrong place


@pytest.mark.parametrize("index,cut", [(0, 1), (2, -1), (2, 1)])
def test_a_chunk_of_the_wrong_length_or_index_is_bad(two_blobs, index, cut):
    a, _ = two_blobs
    c = checker_for("tensor:a", a)
    good = chunks(a)[min(max(index, 0), 2)]
    data = good[:len(good) - cut] if cut > 0 else good + b"x" * -cut
    with pytest.raises(wp.BadChunk, match=rf"^tensor:a: chunk {index} has {len(data)} bytes, not "):
        c.check(index, data)


@pytest.mark.parametrize("index", [3, -1])
def test_an_index_out_of_range_is_named_as_such(two_blobs, index):
    a, _ = two_blobs
    c = checker_for("tensor:a", a)
    with pytest.raises(wp.BadChunk) as e:
        c.check(index, chunks(a)[min(max(index, 0), 2)])
    assert str(e.value) == f"tensor:a has chunks 0..2, not {index}"


def test_one_changed_byte_is_caught(two_blobs):
    a, _ = two_blobs
    c = checker_for("tensor:a", a)
    last = bytearray(chunks(a)[2])
    last[len(last) // 2] ^= 0x01
    with pytest.raises(wp.BadChunk, match="chunk 2 does not match"):
        c.check(2, bytes(last))


def test_hashes_that_do_not_hash_to_the_root_are_refused(two_blobs):
    a, b = two_blobs
    c = checker_for("tensor:a", a, with_hashes=False)
    assert c.needs_hashes
    with pytest.raises(wp.WeightsError, match="chunk hashes are needed before chunk 0 can be checked"):
        c.check(0, chunks(a)[0])
    ha = hashes_of(a)
    for bad in (hashes_of(b), ha[:-32], ha + ha[:32], ha[:5] + bytes([ha[5] ^ 0x80]) + ha[6:]):
        with pytest.raises(wp.BadChunk, match="^tensor:a: chunk hashes do not match the manifest's root$"):
            c.set_hashes(bad)
    assert c.needs_hashes  # nothing trusted from a refused list
    c.set_hashes(ha)
    c.check(2, chunks(a)[2])


def test_one_chunk_blob_is_checked_from_itself():
    data = os.urandom(1000)
    c = checker_for("file:config.json", data, with_hashes=False)
    assert c.count == 1 and not c.needs_hashes
    with pytest.raises(wp.BadChunk, match="^file:config.json: its bytes do not match the manifest$"):
        c.check(0, data[:-1] + bytes([data[-1] ^ 1]))
    c.check(0, data)
    assert c.hashes == wp.chunk_hash(data)
    # a whole chunk exactly is still one chunk
    full = blob_of(CS, 3)
    checker_for("tensor:full", full, with_hashes=False).check(0, full)


def test_empty_blob():
    c = checker_for("file:empty", b"", with_hashes=False)
    assert c.count == 1 and not c.needs_hashes
    assert c.root == wp.blob_root(0, hashlib.sha256(b"").digest())
    c.check(0, b"")
    with pytest.raises(wp.BadChunk, match="chunk 0 has 1 bytes, not 0"):
        c.check(0, b"x")


# -- the two ends of a stream -----------------------------------------------------------------------
REQUESTS = [
    wp.Request("have", MODEL),
    wp.Request("manifest", MODEL, index=0, length=wp.MAX_MANIFEST_RANGE),
    wp.Request("hashes", MODEL, blob="tensor:model.layers.0.mlp.up_proj.weight"),
    wp.Request("chunk", MODEL, blob="tensor:model.layers.0.mlp.up_proj.weight", index=3),
    wp.Request("chunk", MODEL, blob="file:config.json"),
]
REPLIES = [
    wp.Reply(True, prefixes=("file:", "tensor:model.layers.0.")),
    wp.Reply(True, data=b"m" * 40, total=40),
    wp.Reply(True, data=b"h" * 64),
    wp.Reply.failure("not_held", "this peer does not hold it"),
    wp.Reply(True, data=b"{}"),
]


def feed_split(machine, wire: bytes, cut: int) -> list:
    return machine.receive_data(wire[:cut]) + machine.receive_data(wire[cut:])


def test_requests_survive_a_cut_at_every_position():
    wire = b"".join(wp.WeightsClient().send(r) for r in REQUESTS)
    for cut in range(len(wire) + 1):
        assert feed_split(wp.WeightsServer(), wire, cut) == REQUESTS, cut
    server = wp.WeightsServer()
    assert [r for i in range(len(wire)) for r in server.receive_data(wire[i:i + 1])] == REQUESTS


def test_replies_survive_a_cut_at_every_position_and_pair_in_order():
    server = wp.WeightsServer()
    server.receive_data(b"".join(wp.WeightsClient().send(r) for r in REQUESTS))
    wire = b"".join(server.send(r) for r in REPLIES)
    for cut in range(len(wire) + 1):
        client = wp.WeightsClient()
        for r in REQUESTS:
            client.send(r)
        assert feed_split(client, wire, cut) == list(zip(REQUESTS, REPLIES)), cut
        assert client.in_flight == 0
        client.end_of_stream()
    client = wp.WeightsClient()
    for r in REQUESTS:
        client.send(r)
    got = [p for i in range(len(wire)) for p in client.receive_data(wire[i:i + 1])]
    assert got == list(zip(REQUESTS, REPLIES))


def test_a_failure_reply_keeps_its_code_and_a_short_error():
    r = wp.Reply.failure("busy", "x" * 1000)
    assert r.error == "x" * 300
    assert wp.parse_reply(cbor2.dumps(r.to_wire())) == r


def test_no_more_than_max_in_flight():
    client, server = wp.WeightsClient(), wp.WeightsServer()
    wire = b"".join(client.send(wp.Request("have", MODEL)) for _ in range(wp.MAX_IN_FLIGHT))
    with pytest.raises(wp.WeightsError, match=f"at most {wp.MAX_IN_FLIGHT} weights requests may be in flight"):
        client.send(wp.Request("have", MODEL))
    assert client.in_flight == wp.MAX_IN_FLIGHT
    assert len(server.receive_data(wire)) == wp.MAX_IN_FLIGHT
    # one reply frees one slot at both ends
    assert len(client.receive_data(server.send(wp.Reply(True)))) == 1
    extra = client.send(wp.Request("have", MODEL))
    assert len(server.receive_data(extra)) == 1
    # a fetcher that ignores the limit is refused by the server
    greedy = b"".join(wp.WeightsClient().send(wp.Request("have", MODEL)) for _ in range(wp.MAX_IN_FLIGHT)) * 2
    with pytest.raises(wp.WeightsError, match=f"more than {wp.MAX_IN_FLIGHT} weights requests in flight"):
        wp.WeightsServer().receive_data(greedy)


def request_frame(**fields) -> bytes:
    m = wp.Request("chunk", MODEL, blob="tensor:x").to_wire() | fields
    return encode_frame(cbor2.dumps(m, canonical=True))


@pytest.mark.parametrize("fields,message", [
    ({"v": 2}, r"^weights protocol version 2 is not supported \(this peer speaks 1\)$"),
    ({"v": None}, "version None is not supported"),
    ({"op": "delete"}, r"^unknown weights op 'delete'$"),
    ({"op": None}, "unknown weights op None"),
    ({"model": "ab" * 31}, "^malformed weights chunk request$"),
    ({"model": 5}, "malformed weights chunk request"),
    ({"blob": 7}, "malformed weights chunk request"),
    ({"blob": "x" * 1025}, "malformed weights chunk request"),
    ({"index": -1}, "malformed weights chunk request"),
    ({"index": True}, "malformed weights chunk request"),
    ({"index": 1.0}, "malformed weights chunk request"),
    ({"length": -5}, "malformed weights chunk request"),
    ({"op": "manifest", "length": 0}, r"^manifest range of 0 bytes is outside 1\.\.4194304$"),
    ({"op": "manifest", "length": wp.MAX_MANIFEST_RANGE + 1}, "manifest range of 4194305 bytes"),
])
def test_bad_requests_are_refused_saying_why(fields, message):
    with pytest.raises(wp.WeightsError, match=message):
        wp.WeightsServer().receive_data(request_frame(**fields))


def test_missing_field_and_non_map_and_non_cbor_requests():
    m = wp.Request("have", MODEL).to_wire()
    del m["index"]
    with pytest.raises(wp.WeightsError, match="malformed weights have request"):
        wp.parse_request(cbor2.dumps(m))
    with pytest.raises(wp.WeightsError, match="^weights request is not a map$"):
        wp.parse_request(cbor2.dumps([1, 2]))
    with pytest.raises(wp.WeightsError, match="^weights request is not CBOR: "):
        wp.parse_request(b"\xff\xff")


def reply_payload(**fields) -> bytes:
    return cbor2.dumps(wp.Reply(True, data=b"abc").to_wire() | fields)


@pytest.mark.parametrize("payload,message", [
    (reply_payload(v=2), "^weights reply is not a version-1 map$"),
    (cbor2.dumps("ok"), "not a version-1 map"),
    (b"\xff", "^weights reply is not CBOR"),
    (reply_payload(ok="yes"), "^malformed weights reply$"),
    (reply_payload(data="abc"), "malformed weights reply"),
    (reply_payload(total=-1), "malformed weights reply"),
    (reply_payload(total=False), "malformed weights reply"),
    (reply_payload(prefixes=[1]), "malformed weights reply"),
    (reply_payload(prefixes=["p"] * 4097), "malformed weights reply"),
    (cbor2.dumps({"v": 1, "ok": False, "code": 3, "error": "x"}), "^malformed weights error reply$"),
    (cbor2.dumps({"v": 1, "ok": False, "code": "busy"}), "malformed weights error reply"),
])
def test_bad_replies_are_refused_saying_why(payload, message):
    client = wp.WeightsClient()
    client.send(wp.Request("have", MODEL))
    with pytest.raises(wp.WeightsError, match=message):
        client.receive_data(encode_frame(payload))


def test_replies_larger_than_asked_are_refused():
    client = wp.WeightsClient()
    client.send(wp.Request("manifest", MODEL, length=10))
    with pytest.raises(wp.WeightsError, match="^manifest reply is longer than the range asked for$"):
        client.receive_data(encode_frame(cbor2.dumps(wp.Reply(True, data=b"x" * 11, total=11).to_wire())))
    client = wp.WeightsClient()
    client.send(wp.Request("chunk", MODEL, blob="tensor:x"))
    reply = wp.Reply(True, data=b"x" * (CS + 1))
    with pytest.raises(wp.WeightsError, match=rf"^chunk reply of {CS + 1} bytes is larger than a chunk$"):
        client.receive_data(encode_frame(cbor2.dumps(reply.to_wire()), wp.MAX_REPLY_BYTES))


def test_oversize_frames_are_refused_before_buffering():
    # checked against the declared length: no body needs to arrive
    with pytest.raises(ShardnetError, match=f"declared frame length {wp.MAX_REQUEST_BYTES + 1} exceeds"):
        wp.WeightsServer().receive_data(HEADER.pack(wp.MAX_REQUEST_BYTES + 1))
    client = wp.WeightsClient()
    client.send(wp.Request("have", MODEL))
    with pytest.raises(ShardnetError, match=f"declared frame length {wp.MAX_REPLY_BYTES + 1} exceeds"):
        client.receive_data(HEADER.pack(wp.MAX_REPLY_BYTES + 1))
    # a reply at the limit passes the framing (then fails on its content, as garbage)
    client = wp.WeightsClient()
    client.send(wp.Request("have", MODEL))
    with pytest.raises(wp.WeightsError, match="not CBOR"):
        client.receive_data(HEADER.pack(wp.MAX_REPLY_BYTES) + b"\xff" * wp.MAX_REPLY_BYTES)


def test_oversize_frames_are_weights_errors():
    with pytest.raises(wp.WeightsError):
        wp.WeightsServer().receive_data(HEADER.pack(wp.MAX_REQUEST_BYTES + 1))


def test_a_request_too_large_to_send_is_not_left_in_flight():
    client = wp.WeightsClient()
    with pytest.raises(ShardnetError):
        client.send(wp.Request("chunk", MODEL, blob="\U0001F600" * 1024))
    assert client.in_flight == 0


def test_a_reply_without_a_request_is_refused():
    reply = encode_frame(cbor2.dumps(wp.Reply(True).to_wire()))
    with pytest.raises(wp.WeightsError, match="^weights reply without a request$"):
        wp.WeightsClient().receive_data(reply)
    client = wp.WeightsClient()
    client.send(wp.Request("have", MODEL))
    with pytest.raises(wp.WeightsError, match="weights reply without a request"):
        client.receive_data(reply * 2)
    with pytest.raises(wp.WeightsError, match="^a weights reply needs a request to answer$"):
        wp.WeightsServer().send(wp.Reply(True))


def test_end_of_stream_with_requests_unanswered():
    client = wp.WeightsClient()
    client.end_of_stream()  # nothing asked, nothing owed
    for r in REQUESTS[:3]:
        client.send(r)
    with pytest.raises(wp.WeightsError, match="^the peer closed the stream with 3 weights requests unanswered$"):
        client.end_of_stream()
    server = wp.WeightsServer()
    server.receive_data(b"".join(wp.WeightsClient().send(r) for r in REQUESTS[:3]))
    wire = b"".join(server.send(r) for r in REPLIES[:3])
    client.receive_data(wire[:-1])
    with pytest.raises(wp.WeightsError, match="with 1 weights requests unanswered"):
        client.end_of_stream()  # the last reply was cut short
    client.receive_data(wire[-1:])
    client.end_of_stream()


# -- properties ---------------------------------------------------------------------------------------
request_st = st.builds(
    wp.Request,
    op=st.sampled_from(wp.OPS),
    model=st.just(MODEL),
    blob=st.text(max_size=40),
    index=st.integers(0, 2**40),
    length=st.integers(1, wp.MAX_MANIFEST_RANGE),
)
reply_st = st.one_of(
    st.builds(wp.Reply, ok=st.just(True), data=st.binary(max_size=200),
              prefixes=st.lists(st.text(max_size=20), max_size=5).map(tuple), total=st.integers(0, 2**40)),
    st.builds(wp.Reply.failure, st.sampled_from(wp.ERROR_CODES), st.text(max_size=50)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(request_st, reply_st), min_size=1, max_size=wp.MAX_IN_FLIGHT),
       st.lists(st.integers(1, 60), min_size=1, max_size=20))
def test_any_exchange_cut_anyhow_pairs_every_reply_with_its_request(exchange, cuts):
    requests = [q for q, _ in exchange]
    replies = [r if q.op != "manifest" or len(r.data) <= q.length else wp.Reply(True) for q, r in exchange]
    client, server = wp.WeightsClient(), wp.WeightsServer()

    def cut_up(wire: bytes):
        i, k = 0, 0
        while i < len(wire):
            yield wire[i:i + cuts[k % len(cuts)]]
            i, k = i + cuts[k % len(cuts)], k + 1

    got_requests = [q for piece in cut_up(b"".join(client.send(q) for q in requests))
                    for q in server.receive_data(piece)]
    assert got_requests == requests
    got = [p for piece in cut_up(b"".join(server.send(r) for r in replies)) for p in client.receive_data(piece)]
    assert got == list(zip(requests, replies))
    client.end_of_stream()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_is_refused_only_with_shardnet_errors(junk):
    for machine in (wp.WeightsServer(), wp.WeightsClient()):
        if isinstance(machine, wp.WeightsClient):
            machine.send(wp.Request("have", MODEL))
        try:
            machine.receive_data(junk)
        except ShardnetError:
            pass
