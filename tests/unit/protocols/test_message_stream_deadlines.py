"""The activation driver's deadlines and stream ends (protocols/activation_io.MessageStream), over
in-memory streams with trio's MockClock: a timeout costs no real time and lands at an exact
virtual instant."""

import pytest
import trio

from shardnet.protocols import activation as ap
from shardnet.protocols.activation_io import MessageStream
from shardnet.testing.memory import stream_pair


async def test_a_silent_peer_times_out_recv_at_its_deadline(autojump_clock):
    # the router answers exactly this exception with a "timeout" error reply (first frame)
    _, theirs = stream_pair()
    ms = MessageStream(theirs)
    t0 = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        await ms.recv(7.5)
    assert trio.current_time() - t0 == 7.5


async def test_a_peer_dribbling_a_frame_cannot_stretch_recv_past_its_deadline(autojump_clock):
    # one byte a second, each read well within the timeout: the deadline is the whole message's
    mine, theirs = stream_pair()
    ms = MessageStream(theirs)

    async def dribble() -> None:
        await mine.write((1000).to_bytes(4, "big"))
        for _ in range(1000):
            await trio.sleep(1)
            await mine.write(b"\xa0")

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(dribble)
        with pytest.raises(trio.TooSlowError):
            await ms.recv(10)
        nursery.cancel_scope.cancel()
    assert trio.current_time() - t0 == 10


async def test_a_stream_that_ends_inside_a_frame_is_malformed(autojump_clock):
    mine, theirs = stream_pair()
    ms = MessageStream(theirs)
    await mine.write((100).to_bytes(4, "big") + b"\x00" * 10)  # a length prefix and 10 of its 100 bytes
    await mine.close()
    with pytest.raises(ap.ActivationProtocolError, match="stream ended inside a frame"):
        await ms.recv(5)


async def test_a_stream_that_ends_between_frames_is_a_clean_end(autojump_clock):
    mine, theirs = stream_pair()
    ms = MessageStream(theirs)
    await mine.close()
    t0 = trio.current_time()
    assert await ms.recv(5) is None
    assert trio.current_time() == t0  # at once, not at the deadline
