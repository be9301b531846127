"""Cancellation never breaks a connection: the single writer per connection (compat fix 15), over
real connections. The writer on its own: tests/unit/transport/test_conn_writer.py."""

import random

import pytest
import torch
import trio

from bench.cancel_torture import table, torture  # noqa: E402
from shardnet.transport import open_node  # noqa: E402


# -- real connections --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("path,rounds", [("direct", 1000), ("relayed", 100)])  # (relayed: 0.2-0.5 s a round)
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
