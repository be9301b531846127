"""Round-trip probes of peers (libp2p ping), one set per node, shared by every request.

Routing compares peers by round trip, healing asks which peers of a broken chain still answer,
and a gateway runs many requests at once that need the same peers measured. Probing each time
from each request multiplied the ping streams a peer saw from one client (and a peer resets
ping streams over its ``ping_streams_per_peer``), so a live peer could look dead exactly when
it was busiest. Here:

- one probe per peer at a time: a request that needs a peer being probed waits for that probe;
- a recent result is reused (``max_age``);
- at most ``probes_in_flight`` probes run at once (the node's limit);
- a probe that fails says what kind of failure it was. ``gone``: the peer could not be reached
  at all (no connection could be made). ``slow``: a connection is up but the ping was reset or
  timed out, which is what a busy peer looks like: a costly hop, not a dead one.

Several pings go over one stream (the least round trip counts: one sample can land behind a
busy moment at either end).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

import trio

from shardnet.transport.errors import ShardnetError
from shardnet.transport.host import PING_BYTES, PING_PROTOCOL
from shardnet.transport.node import Node

log = logging.getLogger(__name__)

#: how long a probe's verdict stands (seconds), by kind; a newer claim from the peer clears it
ALIVE_S = 30.0
SLOW_S = 5.0
GONE_S = 30.0


@dataclass(frozen=True)
class Probe:
    peer: str
    verdict: str  # "alive", "slow" or "gone"
    rtt: float | None  # seconds (alive only)
    at: float  # trio time it finished
    error: str | None = None

    def fresh(self, max_age: float, now: float) -> bool:
        limit = {"alive": ALIVE_S, "slow": SLOW_S, "gone": GONE_S}[self.verdict]
        return now - self.at <= min(max_age, limit)


class Probes:
    """The node's probes (one per node, in its ``InferenceServices``: no work of its own)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.budget = trio.CapacityLimiter(node.config.limits.probes_in_flight)
        self.results: dict[str, Probe] = {}
        #: rtts measured last per peer, kept past their verdict (a route's cost estimate)
        self.rtts: dict[str, float] = {}
        self._inflight: dict[str, trio.Event] = {}
        #: peer -> when its verdict was last dropped for a newer claim
        self._forgotten: dict[str, float] = {}
        self.sent = 0  # probes run (not the ones shared)

    def forget(self, peer: str) -> None:
        """Drop ``peer``'s verdict (it published a newer claim: it may be back); a probe of it
        running now leaves no verdict either (it may have started before the peer came back)."""
        self.results.pop(peer, None)
        self._forgotten[peer] = trio.current_time()

    def verdict(self, peer: str, max_age: float = GONE_S) -> str | None:
        p = self.results.get(peer)
        return p.verdict if p is not None and p.fresh(max_age, trio.current_time()) else None

    async def probe(self, peers, *, max_age: float = ALIVE_S, timeout: float = 2.0,
                    samples: int = 1) -> dict[str, Probe]:
        """A verdict per peer: reused when no older than ``max_age`` (0: a probe that finishes
        after this call starts), else measured now (or taken from the probe already running)."""
        asked = trio.current_time()
        out: dict[str, Probe] = {}

        async def one(peer: str) -> None:
            while True:
                p = self.results.get(peer)
                if p is not None and (p.at >= asked or p.fresh(max_age, trio.current_time())):
                    out[peer] = p
                    return
                running = self._inflight.get(peer)
                if running is None:
                    break
                with trio.move_on_after(timeout * samples + 5.0):
                    await running.wait()
                if peer not in self._inflight or self._inflight[peer] is not running:
                    continue
                out[peer] = Probe(peer, "slow", None, trio.current_time(), "the probe in flight took too long")
                return
            done = self._inflight[peer] = trio.Event()
            started = trio.current_time()
            try:
                out[peer] = await self._measure(peer, timeout, samples)
            finally:  # (a cancelled probe leaves no verdict: whoever waited on it probes again)
                if peer in out and self._forgotten.get(peer, -1.0) < started:
                    self.results[peer] = out[peer]
                del self._inflight[peer]
                done.set()

        async with trio.open_nursery() as nursery:
            for peer in dict.fromkeys(str(p) for p in peers):
                nursery.start_soon(one, peer)
        return out

    async def _measure(self, peer: str, timeout: float, samples: int) -> Probe:
        async with self.budget:
            self.sent += 1
            try:
                with trio.fail_after(timeout * samples + 1.0):
                    rtt = await self._ping(peer, timeout, samples)
            except Exception as e:  # (ShardnetError, TooSlowError, OSError, or py-libp2p's own)
                why = str(e) or type(e).__name__
                connected = peer in {str(p) for p in self.node.peers()}
                verdict = "slow" if connected else "gone"
                log.debug("probe of %s: %s (%s)", peer[:16], verdict, why)
                return Probe(peer, verdict, None, trio.current_time(), why)
        self.rtts[peer] = rtt
        return Probe(peer, "alive", rtt, trio.current_time())

    async def _ping(self, peer: str, timeout: float, samples: int) -> float:
        stream = await self.node.new_stream(peer, PING_PROTOCOL, timeout=timeout)
        best = float("inf")
        try:
            for _ in range(max(1, samples)):
                payload = secrets.token_bytes(PING_BYTES)
                t0 = time.perf_counter()
                await stream.write(payload, timeout=timeout)
                echo = await stream.read_exactly(PING_BYTES, timeout=timeout)
                best = min(best, time.perf_counter() - t0)
                if echo != payload:
                    raise ShardnetError(f"peer {peer[:16]} answered a ping with other bytes")
        finally:
            await stream.close()
        return best
