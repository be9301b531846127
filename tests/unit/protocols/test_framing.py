import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardnet.protocols.framing import HEADER, FrameDecoder, FrameError, encode_frame


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=10), st.lists(st.integers(1, 50), min_size=1))
def test_any_chunking_yields_the_same_frames(frames, cuts):
    wire = b"".join(encode_frame(f) for f in frames)
    dec = FrameDecoder()
    got, i, k = [], 0, 0
    while i < len(wire):
        n = cuts[k % len(cuts)]
        got += dec.feed(wire[i:i + n])
        i, k = i + n, k + 1
    assert got == frames
    assert dec.pending == 0


def test_oversize_declared_length_is_refused_before_buffering():
    dec = FrameDecoder(max_frame=1000)
    with pytest.raises(FrameError, match="declared frame length 4294967295"):
        dec.feed(HEADER.pack(0xFFFFFFFF))


def test_encoder_refuses_oversize():
    with pytest.raises(FrameError):
        encode_frame(b"x" * 11, max_frame=10)


def test_partial_frame_is_pending():
    dec = FrameDecoder()
    assert dec.feed(encode_frame(b"hello")[:6]) == []
    assert dec.pending == 6
