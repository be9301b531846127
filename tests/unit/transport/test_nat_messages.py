"""DCUtR and AutoNAT v1 codecs: round trips, agreement with independently produced protobuf
bytes (py-libp2p's generated DCUtR code; the AutoNAT spec's field numbers written out by hand),
and only clean errors on bad bytes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardnet.testing.factories import frame_body
from shardnet.transport.nat.autonat_messages import (
    AutoNATMessage,
    AutoNATType,
    Dial,
    DialResponse,
    DialStatus,
    decode_autonat,
    encode_autonat,
)
from shardnet.transport.nat.holepunch_messages import (
    HolePunch,
    HolePunchType,
    decode_holepunch,
    encode_holepunch,
)
from shardnet.transport.nat.pbwire import (
    MAX_MESSAGE,
    FrameBuffer,
    MessageError,
    encode_varint,
)


def test_holepunch_round_trip_and_generated_code_agree():
    pb = pytest.importorskip("libp2p.relay.circuit_v2.pb.dcutr_pb2")
    m = HolePunch(HolePunchType.CONNECT, [b"\x04\xcb\x00\x71\x65\x06\x0f\xa1", b"\x04\x7f\x00\x00\x01"])
    assert decode_holepunch(frame_body(encode_holepunch(m))) == m
    theirs = pb.HolePunch.FromString(frame_body(encode_holepunch(m)))
    assert theirs.type == 100 and list(theirs.ObsAddrs) == m.addrs
    sync = pb.HolePunch(type=pb.HolePunch.SYNC).SerializeToString()
    assert decode_holepunch(sync) == HolePunch(HolePunchType.SYNC, [])


def _pb_bytes(number: int, payload: bytes) -> bytes:
    return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


def test_autonat_matches_the_spec_field_numbers():
    # Message{type=1, dial=2{peer=1{id=1, addrs=2}}, dialResponse=3{status=1, statusText=2, addr=3}}
    peer = _pb_bytes(1, b"ID") + _pb_bytes(2, b"A1") + _pb_bytes(2, b"A2")
    dial = b"\x08\x00" + _pb_bytes(2, _pb_bytes(1, peer))
    assert frame_body(encode_autonat(AutoNATMessage(AutoNATType.DIAL, dial=Dial(b"ID", [b"A1", b"A2"])))) == dial
    assert decode_autonat(dial).dial == Dial(b"ID", [b"A1", b"A2"])
    resp = b"\x08\x01" + _pb_bytes(3, b"\x08\x64" + _pb_bytes(2, b"no answer"))
    assert decode_autonat(resp).response == DialResponse(DialStatus.E_DIAL_ERROR, "no answer", None)
    ok = AutoNATMessage(AutoNATType.DIAL_RESPONSE, response=DialResponse(DialStatus.OK, None, b"ADDR"))
    assert decode_autonat(frame_body(encode_autonat(ok))) == ok


@pytest.mark.parametrize("bad", [
    b"", b"\x08\x07",  # no type / unknown type
    b"\x08\x00",  # DIAL without a peer
    b"\x08\x01",  # DIAL_RESPONSE without a response
    b"\x08\x00" + _pb_bytes(2, b""),  # dial without its peer
    b"\x08\x01" + _pb_bytes(3, _pb_bytes(2, b"\xff\xfe")),  # status missing, text not UTF-8
    b"\x12\x05ab",  # truncated field
])
def test_bad_autonat_messages(bad):
    with pytest.raises(MessageError):
        decode_autonat(bad)


@pytest.mark.parametrize("bad", [b"", b"\x08\x01", b"\x08\xe4\x00\x12\x05ab", b"\x0b"])
def test_bad_holepunch_messages(bad):
    with pytest.raises(MessageError):
        decode_holepunch(bad)


def test_oversize_messages_are_refused_both_ways():
    with pytest.raises(MessageError):
        encode_holepunch(HolePunch(HolePunchType.CONNECT, [b"x" * MAX_MESSAGE]))
    fb = FrameBuffer()
    fb.feed(encode_varint(MAX_MESSAGE + 1))
    with pytest.raises(MessageError):
        fb.next_body()


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_fail_cleanly(data):
    for decode in (decode_holepunch, decode_autonat):
        try:
            decode(data)
        except MessageError:
            pass
