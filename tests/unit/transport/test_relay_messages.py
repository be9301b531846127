"""Circuit relay v2 codec: round trips, agreement with an independent protobuf implementation
(the code py-libp2p generated from the spec's .proto), and only clean errors on bad bytes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardnet.testing.factories import frame_body
from shardnet.transport.nat.relay_messages import (
    MAX_MESSAGE,
    FrameBuffer,
    HopMessage,
    HopType,
    Limit,
    Peer,
    RelayProtocolError,
    Reservation,
    Status,
    StopMessage,
    StopType,
    decode_hop,
    decode_stop,
    encode_hop,
    encode_stop,
    encode_varint,
)


def test_round_trips():
    msgs = [HopMessage(HopType.RESERVE),
            HopMessage(HopType.CONNECT, peer=Peer(b"\x00\x24" + b"x" * 36, [b"\x04\x7f\x00\x00\x01"])),
            HopMessage(HopType.STATUS, reservation=Reservation(1_900_000_000, [b"a", b"b"], b"v"),
                       limit=Limit(120, 1 << 20), status=Status.OK)]
    for m in msgs:
        assert decode_hop(frame_body(encode_hop(m))) == m
    s = StopMessage(StopType.CONNECT, peer=Peer(b"id"), limit=Limit(data=5))
    assert decode_stop(frame_body(encode_stop(s))) == s
    no_reservation = StopMessage(StopType.STATUS, status=Status.NO_RESERVATION)
    assert decode_stop(frame_body(encode_stop(no_reservation))).status == 204


def test_agrees_with_the_generated_protobuf_code():
    pb = pytest.importorskip("libp2p.relay.circuit_v2.pb.circuit_pb2")
    ours = HopMessage(HopType.STATUS, reservation=Reservation(1234, [b"addr"], b"voucher"),
                      limit=Limit(60, 4096), status=Status.OK)
    theirs = pb.HopMessage.FromString(frame_body(encode_hop(ours)))
    assert (theirs.type, theirs.reservation.expire, list(theirs.reservation.addrs)) == (2, 1234, [b"addr"])
    assert (theirs.limit.duration, theirs.limit.data, theirs.status) == (60, 4096, 100)
    msg = pb.HopMessage(type=pb.HopMessage.CONNECT)
    msg.peer.id = b"peer-id"
    msg.peer.addrs.append(b"a1")
    assert decode_hop(msg.SerializeToString()) == HopMessage(HopType.CONNECT, peer=Peer(b"peer-id", [b"a1"]))


def test_frames_split_anywhere_and_leave_the_rest():
    frame = encode_hop(HopMessage(HopType.STATUS, status=Status.OK)) + b"RELAYED BYTES"
    for cut in range(len(frame)):
        fb = FrameBuffer()
        fb.feed(frame[:cut])
        got = fb.next_body()
        fb.feed(frame[cut:])
        got = got or fb.next_body()
        assert decode_hop(got).status == Status.OK
        assert fb.take_rest() == b"RELAYED BYTES"


@pytest.mark.parametrize("bad", [
    encode_varint(MAX_MESSAGE + 1) + b"x",  # oversize frame
    b"\xff" * 11,  # endless length prefix
])
def test_bad_frames(bad):
    fb = FrameBuffer()
    fb.feed(bad)
    with pytest.raises(RelayProtocolError):
        fb.next_body()


@pytest.mark.parametrize("bad", [b"", b"\x08\x07", b"\x08", b"\x12\x05ab", b"\x0b", b"\x00\x01"])
def test_bad_messages(bad):
    with pytest.raises(RelayProtocolError):
        decode_hop(bad)
    with pytest.raises(RelayProtocolError):
        decode_stop(bad)
    with pytest.raises(RelayProtocolError):
        encode_hop(HopMessage(HopType.CONNECT, peer=Peer(b"x" * (MAX_MESSAGE + 1))))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_never_raises_anything_else(data):
    for decode in (decode_hop, decode_stop):
        try:
            decode(data)
        except RelayProtocolError:
            pass
    fb = FrameBuffer()
    fb.feed(data)
    try:
        while fb.next_body() is not None:
            pass
    except RelayProtocolError:
        pass
