"""What a broken chain is healed into: the decision ``HealingSession`` takes when some of its
chain's peers failed, pure (no trio, no torch), so that bench/swarm_sim calls it as the client does.

The new chain avoids the failed peers and keeps the rest of the old one: the kept claims go to
``RoutePlanner.find_route(keep=...)``, whose ``routing.ChainCost`` discounts their peers
(``KEEP_DISCOUNT``), so the cheapest chain replaces exactly the failed spans where claims line up
with their boundaries, and is a whole new chain where none do (plan_route decides that by cost,
not this module).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shardnet.protocols.block_claim import Claim


@dataclass(frozen=True)
class HealPlan:
    #: peers the healed chain must not go through
    avoid: frozenset[str]
    #: the old chain's other hops, in chain order: preferred, so that only the failed spans change
    keep: list[Claim]
    #: the spans the failed peers served, in chain order: what the healed chain serves anew
    replace: list[tuple[int, int]]


def plan_heal(chain: list[Claim], failed: Iterable[str]) -> HealPlan:
    """How to heal ``chain`` now that the peers ``failed`` failed (or are to be left)."""
    failed = frozenset(failed)
    return HealPlan(avoid=failed, keep=[c for c in chain if c.peer not in failed],
                    replace=[(c.start, c.end) for c in chain if c.peer in failed])
