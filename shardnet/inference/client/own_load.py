"""``OwnLoad``: the KV cache this node's open sessions hold at each peer, which routing adds to
what the peers' claims say.

A claim's ``load`` is as old as the claim (republished every third of its TTL), so a gateway
that routed by it alone sent every request of those seconds down the same cheapest chain until
the chain refused them; bench/swarm_sim showed most sessions failing "busy" at a third of the
swarm's KV capacity. The node knows its own sessions exactly: a peer's load, for routing, is at
least the share of its KV budget this node's sessions hold."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from shardnet.protocols.block_claim import Claim


class OwnLoad:
    """Per peer, KV tokens held by this node's open sessions (one per node, in its
    ``InferenceServices``: shared by every client, like the claims view)."""

    def __init__(self) -> None:
        self.tokens: Counter[str] = Counter()

    @contextmanager
    def holding(self, route: list[Claim], max_len: int) -> Iterator[None]:
        """Count a session of ``max_len`` tokens on every hop of ``route`` while it is open."""
        for c in route:
            self.tokens[c.peer] += max_len
        try:
            yield
        finally:
            for c in route:
                self.tokens[c.peer] -= max_len
                if self.tokens[c.peer] <= 0:
                    del self.tokens[c.peer]

    def load(self, claim: Claim) -> float:
        """The claim's load, or the share of the peer's KV budget our sessions hold if more: the
        budget in tokens is what the claim said was free over the share it said was free."""
        mine = self.tokens.get(claim.peer, 0)
        if not mine or claim.load >= 1.0 or claim.kv_tokens <= 0:
            return claim.load
        return min(1.0, max(claim.load, mine / (claim.kv_tokens / (1.0 - claim.load))))
