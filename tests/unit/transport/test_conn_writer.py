"""The single writer per connection (compat fix 15) on its own: cancellation never splits a frame,
order, batching, urgency, failure. Over real connections: tests/integration/test_cancel_safety.py."""

import pytest
import trio
import trio.testing

from shardnet.transport.conn_writer import ConnectionWriter, WriterClosed


class _SlowSink:
    """A connection's write: takes ``delay`` per call and records what arrived whole."""

    def __init__(self, delay: float = 0.01, fail_at: int | None = None) -> None:
        self.delay, self.fail_at, self.got, self.closed = delay, fail_at, [], False

    async def write(self, data: bytes) -> None:
        if self.fail_at is not None and len(self.got) == self.fail_at:
            raise OSError("socket died")
        await trio.sleep(self.delay)
        self.got.append(bytes(data))

    async def close(self) -> None:
        self.closed = True


async def test_queued_frames_are_written_whole_even_when_their_sender_is_cancelled():
    sink = _SlowSink()
    w = ConnectionWriter(sink.write, max_queued=1 << 20)
    async with trio.open_nursery() as nursery:
        await nursery.start(w.run)
        with trio.move_on_after(0.001):  # cancelled while its frame is being written
            await w.send(b"a" * 1000)
        await w.send(b"b" * 10)
        assert b"".join(sink.got) == b"a" * 1000 + b"b" * 10
        nursery.cancel_scope.cancel()


async def test_a_sender_cancelled_while_waiting_for_room_has_written_nothing():
    sink = _SlowSink(delay=0.05)
    w = ConnectionWriter(sink.write, max_queued=100)
    async with trio.open_nursery() as nursery:
        await nursery.start(w.run)
        w.push(b"x" * 100)  # fills the queue
        with trio.move_on_after(0.01) as scope:
            await w.send(b"y" * 50)
        assert scope.cancelled_caught
        await w.flush()
        assert b"".join(sink.got) == b"x" * 100
        w.push(b"z")  # control frames are admitted whatever is queued
        await w.flush()
        assert sink.got[-1] == b"z"
        nursery.cancel_scope.cancel()


async def test_a_failed_write_closes_the_connection_and_fails_every_waiter():
    sink = _SlowSink(fail_at=1)
    w = ConnectionWriter(sink.write, max_queued=1 << 20, on_failure=sink.close)
    async with trio.open_nursery() as nursery:
        await nursery.start(w.run)
        await w.send(b"first")
        frames = [w.push(b"doomed %d" % i) for i in range(3)]
        for f in frames:
            with pytest.raises(WriterClosed, match="socket died"):
                await f.written()
        assert sink.closed and w.closed
        with pytest.raises(WriterClosed):
            w.push(b"after")
    assert sink.got == [b"first"]


async def test_frames_keep_their_order_and_are_joined_into_few_writes():
    sink = _SlowSink(delay=0.005)
    w = ConnectionWriter(sink.write, max_queued=1 << 20)
    async with trio.open_nursery() as nursery:
        await nursery.start(w.run)
        parts = [bytes([i]) * 100 for i in range(200)]
        for p in parts:
            w.push(p)
        await w.flush()
        assert b"".join(sink.got) == b"".join(parts)
        assert len(sink.got) < 10
        nursery.cancel_scope.cancel()


async def test_urgent_frames_go_before_queued_data_and_control_frames_are_bounded():
    sink = _SlowSink(delay=0.02)
    w = ConnectionWriter(sink.write, max_queued=100, control_slack=50)
    async with trio.open_nursery() as nursery:
        await nursery.start(w.run)
        w.push(b"d1" * 10)
        await trio.sleep(0.005)  # the writer is busy with d1
        w.push(b"d2" * 10)
        w.push(b"u", urgent=True)
        await w.flush()
        assert sink.got[0] == b"d1" * 10 and sink.got[1].startswith(b"u")  # u jumped d2
        w.push(b"x" * 140)  # data and control past the data bound, within the slack
        with trio.move_on_after(0.01) as scope:  # a flood of control frames meets a bound
            await w.wait_for_room(20, control=True)
        assert scope.cancelled_caught
        nursery.cancel_scope.cancel()


# -- over trio's in-memory streams, on a mock clock ----------------------------------------------
async def test_a_sender_cut_off_while_the_wire_is_blocked_still_gets_its_frame_through_whole(autojump_clock):
    wire, peer = trio.testing.lockstep_stream_pair()  # a write waits until the peer reads
    w = ConnectionWriter(wire.send_all, max_queued=1 << 20)
    async with trio.open_nursery() as nursery:
        await nursery.start(w.run)
        with trio.move_on_after(5) as scope:  # the peer reads nothing for 5 s: the sender gives up
            await w.send(b"0123456789" * 100)
        assert scope.cancelled_caught
        w.push(b"next")
        got = bytearray()
        while len(got) < 1004:
            got += await peer.receive_some()
        assert got == b"0123456789" * 100 + b"next"  # the cut-off frame went out whole, in order
        nursery.cancel_scope.cancel()


async def test_a_wire_that_breaks_fails_every_waiter_and_closes_the_connection_once(autojump_clock):
    wire, peer = trio.testing.memory_stream_pair()
    closes = []

    async def close_connection() -> None:
        closes.append(trio.current_time())

    w = ConnectionWriter(wire.send_all, max_queued=1 << 20, on_failure=close_connection)
    async with trio.open_nursery() as nursery:
        await nursery.start(w.run)
        await w.send(b"first")
        assert await peer.receive_some() == b"first"
        await peer.aclose()
        frames = [w.push(b"doomed %d" % i) for i in range(3)]
        for f in frames:
            with pytest.raises(WriterClosed):
                await f.written()
        with pytest.raises(WriterClosed):
            await w.send(b"after")
    assert w.closed and len(closes) == 1
