"""Probes' verdicts without a network: the ping itself is replaced, the bookkeeping is real."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from shardnet.errors import ShardnetError
from shardnet.inference.probes import Probes


class DeadPeerProbes(Probes):
    """Every ping fails after ``delay`` seconds, as one to a killed process does."""

    def __init__(self, delay: float) -> None:
        node = SimpleNamespace(config=SimpleNamespace(limits=SimpleNamespace(probes_in_flight=4)), peers=lambda: [])
        super().__init__(node)
        self.delay = delay

    async def _ping(self, peer: str, timeout: float, samples: int) -> float:
        await trio.sleep(self.delay)
        raise ShardnetError("connection refused")


async def test_a_dead_peer_is_gone_until_it_claims_again():
    probes = DeadPeerProbes(0.0)
    await probes.probe(["a"])
    assert probes.verdict("a") == "gone"
    probes.forget("a")
    assert probes.verdict("a") is None


async def test_a_probe_running_when_the_peer_claims_again_leaves_no_verdict():
    """The probe started while the old process was dead; the restarted peer's claim arrives
    before it fails: its "gone" would hide a live peer for GONE_S, so it is not kept."""
    probes = DeadPeerProbes(0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probes.probe, ["a"])
        await trio.sleep(0.01)
        probes.forget("a")
    assert probes.verdict("a") is None
    await probes.probe(["a"])  # a probe started after the claim counts
    assert probes.verdict("a") == "gone"
