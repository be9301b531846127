"""What a node's clients have done, for monitors: sessions open and run, tokens made (and the
rate over the last minute), heals and convictions, and the round trip of each chain step.

One per node (in its ``InferenceServices``, inference/services.py), shared by every ``Client`` of it, so a gateway's
many concurrent requests add up in one place. The gateway's dashboard and the Prometheus
metrics read it; nothing here changes what a client does.
"""

from __future__ import annotations

import time
from collections import Counter, deque

from prometheus_client import Histogram

from shardnet.inference.client.audit import AuditStats
from shardnet.inference.latency_buckets import STEP_BUCKETS

#: the window tokens/s is measured over (seconds)
RATE_WINDOW = 60.0
#: AuditStats' counts, each a metric label
AUDIT_OUTCOMES = ("sampled", "checked", "agreed", "disputes", "convictions", "no_witness", "superseded",
                  "incomplete", "dropped")
#: how many recent heals and convictions are kept for display
RECENT_EVENTS = 50


class ClientActivity:
    """Counters of the node's generations (a node-wide service with no work of its own)."""

    def __init__(self) -> None:
        self.sessions_active = 0
        self.sessions_total = 0
        self.sessions_failed = 0
        self.prompt_tokens_total = 0
        self.tokens_total = 0
        self.retracted_total = 0
        self.heals_total = 0
        self.convictions_total = 0
        #: {"time": unix seconds, "kind": "heal" | "conviction", ...}, newest last
        self.events: deque[dict] = deque(maxlen=RECENT_EVENTS)
        #: honest-compute checks by outcome (AuditStats' fields, summed over sessions)
        self.audits: Counter[str] = Counter()
        # not registered anywhere: the node's metrics collector reports it
        self.step_seconds = Histogram("shardnet_client_step_seconds", "a chain step's round trip: sent "
                                      "to its result back", registry=None, buckets=STEP_BUCKETS)
        self._stamps: deque[float] = deque()  # monotonic time of each token in the window

    def session_started(self, prompt_tokens: int) -> None:
        self.sessions_active += 1
        self.sessions_total += 1
        self.prompt_tokens_total += prompt_tokens

    def session_ended(self, *, failed: bool, audit: AuditStats | None = None) -> None:
        self.sessions_active -= 1
        self.sessions_failed += failed
        if audit is not None:
            for outcome in AUDIT_OUTCOMES:
                self.audits[outcome] += getattr(audit, outcome)

    def token(self, *, made: bool = True, retracted: int = 0) -> None:
        """A token made (``made``), and how many made before were withdrawn with it."""
        self.retracted_total += retracted
        if made:
            self.tokens_total += 1
            now = time.monotonic()
            self._stamps.append(now)
            self._forget_before(now - RATE_WINDOW)

    def step(self, seconds: float) -> None:
        """One chain step's round trip (sent to its result back)."""
        self.step_seconds.observe(seconds)

    def healed(self, heal_json: dict) -> None:
        """A recovery (``Heal.to_json()``); one of phase "audit" left a peer convicted of computing wrong."""
        conviction = heal_json.get("phase") == "audit"
        self.heals_total += 1
        self.convictions_total += conviction
        self.events.append({"time": time.time(), "kind": "conviction" if conviction else "heal", **heal_json})

    def tokens_per_s(self, window: float = RATE_WINDOW) -> float:
        """Tokens made per second over the last ``window`` seconds (at most RATE_WINDOW)."""
        now = time.monotonic()
        self._forget_before(now - RATE_WINDOW)
        window = min(window, RATE_WINDOW)
        return sum(1 for t in self._stamps if t >= now - window) / window

    def _forget_before(self, t: float) -> None:
        while self._stamps and self._stamps[0] < t:
            self._stamps.popleft()

    def to_json(self) -> dict:
        return {"sessions_active": self.sessions_active, "sessions_total": self.sessions_total,
                "sessions_failed": self.sessions_failed, "prompt_tokens_total": self.prompt_tokens_total,
                "tokens_total": self.tokens_total, "tokens_per_s": round(self.tokens_per_s(), 2),
                "heals_total": self.heals_total, "convictions_total": self.convictions_total,
                "recent_events": list(self.events)}
