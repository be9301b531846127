"""A Stream's deadlines (transport/stream.py) over in-memory streams with trio's MockClock: every
wait is bounded, whole reads are bounded as a whole, and an early end is told apart from a
timeout."""

import pytest
import trio

from shardnet.testing.memory import stream_pair
from shardnet.transport.errors import OverlayTimeout
from shardnet.transport.stream import StreamClosedError


async def test_read_exactly_is_bounded_as_a_whole_not_per_chunk(autojump_clock):
    mine, theirs = stream_pair()

    async def dribble() -> None:
        for _ in range(100):
            await trio.sleep(1)
            await mine.write(b"x")

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(dribble)
        with pytest.raises(OverlayTimeout, match="read of 100 bytes timed out after 10 s"):
            await theirs.read_exactly(100, timeout=10)
        nursery.cancel_scope.cancel()
    assert trio.current_time() - t0 == 10


async def test_read_exactly_reports_an_early_end_at_once(autojump_clock):
    mine, theirs = stream_pair()
    await mine.write(b"abc")
    await mine.close()
    t0 = trio.current_time()
    with pytest.raises(StreamClosedError, match="stream ended after 3 of 8 bytes"):
        await theirs.read_exactly(8, timeout=10)
    assert trio.current_time() == t0


async def test_bytes_beyond_an_exact_read_are_kept_for_the_next_read(autojump_clock):
    mine, theirs = stream_pair()
    await mine.write(b"headbody-and-more")
    assert await theirs.read_exactly(4) == b"head"
    assert await theirs.read_some(4) == b"body"
    assert await theirs.read_some() == b"-and-more"
    await mine.close()
    assert await theirs.read_some(timeout=1) == b""


async def test_a_write_to_a_peer_that_does_not_read_times_out(autojump_clock):
    mine, _ = stream_pair(lockstep=True)  # nobody reads the other end: like a full TCP window
    t0 = trio.current_time()
    with pytest.raises(OverlayTimeout, match="write timed out after 3 s"):
        await mine.write(b"x" * 100, timeout=3)
    assert trio.current_time() - t0 == 3
