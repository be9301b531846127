"""What this client has seen of each peer's honesty: checks passed, disagreements, convictions,
other clients' gossiped reports, and claims its observed speed belies. Convicted peers are
excluded from routing for good; a peer reported by others only costs more (a report is another
client's word, and a swarm of fake clients could report an honest peer); so does a peer whose
claimed throughput this client saw overstated (peer_speeds.py: the figure is a step time split
among a chain's hops, not proof), for as long as its observations say so."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: a hop through a peer other clients reported costs this many times more, per distinct reporter
REPORTED_COST_FACTOR = 2.0
MAX_REPORTED_FACTOR = 16.0
#: a hop through a peer whose claimed throughput this client saw overstated costs this many times more
OVERCLAIM_COST_FACTOR = 4.0


@dataclass
class PeerRecord:
    passed: int = 0  # checks it took part in where everyone agreed
    disputes: int = 0  # disagreements nobody could settle (no third peer for the span)
    convictions: list[dict] = field(default_factory=list)  # our own evidence
    reported_by: dict[str, dict] = field(default_factory=dict)  # reporter -> summary of its report
    #: how many times more than the typical peer's its claim overstated its observed speed, while
    #: over peer_speeds.OVERCLAIM_FACTOR (None: not so, or not observed)
    overclaim: float | None = None

    @property
    def excluded(self) -> bool:
        return bool(self.convictions)


class Reputation:
    def __init__(self) -> None:
        self.peers: dict[str, PeerRecord] = {}

    def _rec(self, peer: str) -> PeerRecord:
        return self.peers.setdefault(peer, PeerRecord())

    def passed(self, *peers: str) -> None:
        for p in peers:
            self._rec(p).passed += 1

    def dispute(self, *peers: str) -> None:
        for p in peers:
            self._rec(p).disputes += 1

    def convict(self, peer: str, evidence: dict) -> None:
        """``evidence`` is kept as given (the report adds its ID to it once published)."""
        evidence.setdefault("t", time.time())
        self._rec(peer).convictions.append(evidence)

    def note_report(self, report: dict) -> None:
        """A verified gossip report (``receipt_gossip.decode_report``) by someone else."""
        self._rec(report["accused"]).reported_by[report["reporter"]] = {
            "layers": report["layers"], "divergence": report["divergence"], "t": report.get("t")}

    def overclaiming(self, peer: str, ratio: float | None) -> None:
        """What this client's observations now say of ``peer``'s claim (``PeerSpeeds.overclaims``)."""
        if ratio is not None or peer in self.peers:
            self._rec(peer).overclaim = ratio

    def overclaimers(self) -> set[str]:
        return {p for p, r in self.peers.items() if r.overclaim is not None}

    def excluded(self) -> set[str]:
        return {p for p, r in self.peers.items() if r.excluded}

    def cost_factor(self, peer: str) -> float:
        r = self.peers.get(peer)
        if r is None:
            return 1.0
        reported = min(MAX_REPORTED_FACTOR, REPORTED_COST_FACTOR ** len(r.reported_by)) if r.reported_by else 1.0
        return reported * (OVERCLAIM_COST_FACTOR if r.overclaim is not None else 1.0)

    def to_json(self) -> dict:
        return {p: {"passed": r.passed, "disputes": r.disputes, "excluded": r.excluded,
                    "convictions": r.convictions, "reported_by": sorted(r.reported_by), "overclaim": r.overclaim}
                for p, r in self.peers.items()}
