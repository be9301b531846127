"""Limits on open streams fail a new stream at once, with an error naming the limit, and are logged
on the side that refuses (compat fix 17; the peer's stream gate is fix 12)."""

import logging
import re

import pytest
import trio

from shardnet.protocols import echo
from shardnet.transport import open_node
from shardnet.transport.errors import StreamLimitError
from shardnet.transport.identity import short
from shardnet.transport.limits import Limits

CLOSES_AT_ONCE = "/test/closes-at-once/1.0.0"
HOLDS = "/test/holds/1.0.0"
#: the stream gate's rate limits out of the way: these tests open hundreds of streams in a burst
NO_RATE_LIMIT = dict(stream_rate_per_peer=1e6, stream_burst_per_peer=10**6)


async def _open_until_refused(a, peer, protocol, *, read_to_end: bool, most: int = 300):
    """Streams opened (and kept, never closed) until one is refused; (kept, the refusal)."""
    kept = []
    for _ in range(most):
        try:
            with trio.fail_after(5):  # the refusal comes at once, far below the 10 s open timeout
                stream = await a.new_stream(peer, protocol)
        except StreamLimitError as e:
            return kept, e
        if read_to_end:
            assert await stream.read_some(timeout=5) == b""  # the peer has closed its side
        kept.append(stream)
    pytest.fail(f"{most} streams opened and none refused")


def _warnings(caplog, logger: str, *needles: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == logger and r.levelno == logging.WARNING and all(n in r.getMessage() for n in needles)]


async def test_streams_the_peer_closed_hold_the_connection_limit_until_closed_here(loopback_config, caplog):
    caplog.set_level(logging.WARNING)
    async with open_node(loopback_config()) as a, \
            open_node(loopback_config(limits=Limits(**NO_RATE_LIMIT))) as b:
        b.set_stream_handler(CLOSES_AT_ONCE, lambda stream: trio.sleep(0))  # the node closes it on return
        b.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        await a.connect(b.listen_addrs[0])
        kept, refusal = await _open_until_refused(a, b.peer_id, CLOSES_AT_ONCE, read_to_end=True)
        # gossipsub's own stream to b holds one of the 256 slots too
        assert len(kept) >= 250
        assert "the limit of 256 per connection (py-libp2p Yamux)" in str(refusal)
        assert f"{len(kept)} of them were closed by the peer and never closed here" in str(refusal)
        assert short(b.peer_id) in str(refusal) and refusal.code == "stream_limit"
        # the refusing side (a, here) logs it, once for a burst of refusals
        with trio.fail_after(5):
            for _ in range(3):
                with pytest.raises(StreamLimitError):
                    await a.new_stream(b.peer_id, CLOSES_AT_ONCE)
        lines = _warnings(caplog, "shardnet.transport.compat.yamux", "limit of 256 streams", short(b.peer_id))
        assert len(lines) == 1, lines
        # closing them here frees their slots
        for stream in kept:
            await stream.close()
        async with await a.new_stream(b.peer_id, echo.PROTOCOL_ID) as s:
            assert await echo.echo_once(s, b"open again") == b"open again"


async def test_a_peer_over_its_streams_per_peer_refuses_at_once_naming_the_limit(loopback_config, caplog):
    caplog.set_level(logging.WARNING)
    release = trio.Event()
    async with open_node(loopback_config()) as a, \
            open_node(loopback_config(limits=Limits(streams_per_peer=8, **NO_RATE_LIMIT))) as b:
        b.set_stream_handler(HOLDS, lambda stream: release.wait())
        await a.connect(b.listen_addrs[0])
        kept, refusal = await _open_until_refused(a, b.peer_id, HOLDS, read_to_end=False, most=20)
        assert len(kept) <= 8
        assert "streams_per_peer" in str(refusal) and str(b.peer_id)[-6:] in str(refusal)
        held = re.search(r"this node holds (\d+) streams open to it", str(refusal))
        assert held and int(held[1]) >= len(kept)  # gossipsub's stream to b as well
        # b, which refused, logged it
        assert _warnings(caplog, "shardnet.transport.limits", "limit streams_per_peer", short(a.peer_id))
        release.set()
        for stream in kept:
            await stream.close()
        with trio.fail_after(5):
            while True:  # b's gate frees a slot as each handler returns
                try:
                    stream = await a.new_stream(b.peer_id, HOLDS)
                    break
                except StreamLimitError:
                    await trio.sleep(0.05)
        await stream.close()


async def test_streams_over_streams_total_fail_at_once(loopback_config, caplog):
    caplog.set_level(logging.WARNING)
    async with open_node(loopback_config(limits=Limits(streams_total=16))) as a, \
            open_node(loopback_config()) as b:
        b.set_stream_handler(CLOSES_AT_ONCE, lambda stream: trio.sleep(0))
        b.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        await a.connect(b.listen_addrs[0])
        kept, refusal = await _open_until_refused(a, b.peer_id, CLOSES_AT_ONCE, read_to_end=True, most=20)
        assert 0 < len(kept) < 16
        assert "16 streams open to all peers, both directions, its limit streams_total" in str(refusal)
        assert f"{len(kept)} of those it opened were closed by their peer" in str(refusal)
        assert _warnings(caplog, "shardnet.transport.compat.swarm", "limit streams_total (16)")
        for stream in kept:
            await stream.close()
        async with await a.new_stream(b.peer_id, echo.PROTOCOL_ID) as s:
            assert await echo.echo_once(s, b"open again") == b"open again"
