"""What a simulation run measures (bench/swarm_sim/run.py summarizes it): written by the swarm
(peers, placement, messages), the traffic (requests) and the samples."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Stats:
    peers_hours: float = 0.0
    covered_s: float = 0.0
    observed_s: float = 0.0
    observed_peer_s: float = 0.0  # peer-seconds after the warm-up (what messages are counted over)
    gaps: list[tuple[float, bool]] = field(default_factory=list)  # (seconds, spare capacity then)
    samples: list[dict] = field(default_factory=list)
    request_rates: list[tuple[float, int]] = field(default_factory=list)  # (tok/s, weight)
    ttft: list[float] = field(default_factory=list)
    completed: int = 0
    tokens: float = 0.0
    heals: int = 0
    heal_seconds: list[float] = field(default_factory=list)
    failed: Counter = field(default_factory=Counter)
    placed_s: list[float] = field(default_factory=list)
    moves: int = 0
    joins: int = 0
    leaves: int = 0
    #: control messages and their bytes by kind (gossip, dht, ping, direct): bench/swarm_sim/wire.py
    msgs: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    #: claim publications: news (gossip and DHT) and refreshes (DHT only), and why each news was
    publications: Counter = field(default_factory=Counter)
    news_why: Counter = field(default_factory=Counter)
    route_ms: list[float] = field(default_factory=list)
    #: claims in a compute peer's view at each upkeep (``shardnet``)
    view_claims: list[int] = field(default_factory=list)
    uncovered_since: dict[int, tuple[float, bool]] = field(default_factory=dict)
