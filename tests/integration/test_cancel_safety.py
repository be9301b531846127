"""Cancellation never breaks a connection: the single writer per connection (compat fix 15)."""

import random
import sys
from pathlib import Path

import pytest
import torch
import trio

from bench.cancel_torture import table, torture  # noqa: E402
from shardnet.transport import open_node  # noqa: E402
from shardnet.transport.conn_writer import ConnectionWriter, WriterClosed  # noqa: E402


# -- the writer on its own ---------------------------------------------------------------------
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


# -- real connections --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("path,rounds", [("direct", 1200), ("relayed", 600)])
async def test_thousands_of_cut_writes_leave_the_connection_whole(path, rounds):
    r = await torture(path, rounds, seed=7)
    print("\n" + table([r]))
    assert r.cut >= rounds // 2  # most writes really were cut midway
    assert all(n > rounds // 10 for n in r.by_kind.values())  # by each of the three means
    assert r.follow_up_failures == 0, r.first_failures
    assert r.decryption_errors == 0
    assert r.connections_replaced == 0
    assert r.busy_exact and r.busy_bytes > 0, r.first_failures


async def test_a_cut_write_resets_its_stream_instead_of_ending_it(loopback_config):
    """The peer of a write cut after part of it went out sees a reset, never a clean end of
    stream that would pass a truncated message off as whole."""
    outcome = {}
    got_some = trio.Event()

    async def late_reader(stream):
        total = 0
        await trio.sleep(0.5)  # the sender fills the window and waits for more
        try:
            while data := await stream.read_some(1 << 20, timeout=10):
                total += len(data)
                got_some.set()
            outcome["end"] = "eof"
        except Exception as e:
            outcome["end"] = f"error: {e}"
        outcome["bytes"] = total

    async with open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        b.set_stream_handler("/t/late", late_reader)
        await a.connect(b.listen_addrs[0])
        s = await a.new_stream(b.peer_id, "/t/late")
        with trio.move_on_after(0.2) as scope:
            await s.write(b"m" * (32 << 20), timeout=30)  # far more than the window
        assert scope.cancelled_caught
        with trio.fail_after(20):
            while "end" not in outcome:
                await trio.sleep(0.05)
        assert outcome["end"].startswith("error"), outcome
        assert 0 < outcome["bytes"] < 32 << 20
        # ... and the connection is fine
        echo = await a.new_stream(b.peer_id, "/t/late")
        await echo.write(b"still here", timeout=5)


async def test_a_session_cancelled_mid_step_leaves_the_other_session_on_the_connection(
        loopback_config, tmp_path):
    """Two inference sessions from one client to one compute peer share a connection; the first
    is cancelled again and again in the middle of sending a large step, and the second generates
    on, token-identical to a run alone."""
    from shardnet.inference.client.client import Client
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.inference.model.random_model import init_random
    from shardnet.testing.helpers import local_chain

    path = init_random(tmp_path / "llama", "llama", layers=2, hidden=256, heads=4, kv_heads=2, vocab=512,
                       seed=5)
    prompt, new = [3, 17, 42, 99, 7], 24
    rng = random.Random(3)
    async with local_chain(loopback_config, path, [(0, 2)]) as node:
        client = Client(node, LocalModel(path))
        alone = [t.id async for t in client.generate(prompt, max_new_tokens=new, stop_at_eos=False)]
        conns_before = {id(c) for c in node.host.get_network().get_connections()}
        cuts = 0
        both = []

        async def victim():
            nonlocal cuts
            big = client.model.head.embed(torch.randint(0, 512, (1, 1500)))  # a 1.5 MiB frame
            while not both:
                try:
                    async with client.session(1600) as sess:
                        with trio.move_on_after(rng.uniform(0.0005, 0.02)) as scope:
                            await sess.forward(big)
                        cuts += scope.cancelled_caught
                except Exception:
                    pass  # the session ended; what matters is the connection

        async with trio.open_nursery() as nursery:
            nursery.start_soon(victim)
            both.extend([t.id async for t in client.generate(prompt, max_new_tokens=new, stop_at_eos=False)])
        assert both == alone
        assert cuts >= 3
        assert conns_before == {id(c) for c in node.host.get_network().get_connections()}


async def test_a_fin_before_a_reset_reads_as_a_whole_stream_and_a_local_reset_wakes_readers(loopback_config):
    from libp2p.stream_muxer.yamux import yamux as ymod

    ended = {}

    async def fin_then_reset(stream):
        await stream.write(b"whole")
        await stream.raw.close()  # FIN: the data is complete
        await trio.sleep(0.2)
        await stream.raw.reset()  # then a reset, as some peers do

    async with open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        b.set_stream_handler("/t/fin-reset", fin_then_reset)
        await a.connect(b.listen_addrs[0])
        s = await a.new_stream(b.peer_id, "/t/fin-reset")
        await trio.sleep(0.5)  # FIN and RST have both arrived
        assert await s.read_exactly(5, timeout=5) == b"whole"
        assert await s.read_some(timeout=5) == b""  # a clean end, not a reset

        b.set_stream_handler("/t/silent", lambda stream: trio.sleep(5))
        s = await a.new_stream(b.peer_id, "/t/silent")
        muxed = s.raw.muxed_stream
        assert isinstance(muxed, ymod.YamuxStream)

        async def reader():
            try:
                await s.read_some(timeout=10)
                ended["how"] = "eof"
            except Exception as e:
                ended["how"] = type(e).__name__

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(0.1)
            with trio.fail_after(3):  # the reader must not sleep on after our own reset
                await muxed.reset()
                while "how" not in ended:
                    await trio.sleep(0.01)
        assert ended["how"] == "StreamClosedError", ended
