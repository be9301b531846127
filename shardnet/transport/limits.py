"""Resource limits a node enforces against its peers, in one place, each with a default.

Operators set them with ``--limit NAME=VALUE`` (repeatable) on every node command;
``shardnet limits`` prints them all. Embedding apps fill ``NodeConfig.limits``. Exceeding a limit
costs the peer that exceeded it (a reset stream, an error reply), never the node. The last
section bounds what this node asks of others as a client (there, more work waits in line).

Limits that are part of a protocol's definition (the 4 KiB NAT messages, a claim's 16 KiB, a
DHT record's 64 KiB) are not here: a peer cannot change what the other side accepts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from .errors import ShardnetError
from .identity import short

log = logging.getLogger(__name__)


class LimitError(ShardnetError):
    """A --limit setting is unknown or out of range."""

    code = "limit"


def _limit(default: int | float, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass
class Limits:
    # -- streams (every protocol) -------------------------------------------------------------
    streams_per_peer: int = _limit(256, "streams one peer may have open to us at once; more are reset "
                                        "before any protocol is read")
    stream_rate_per_peer: float = _limit(50.0, "new streams per second one peer may open (refill rate)")
    stream_burst_per_peer: int = _limit(200, "new streams one peer may open in a burst")
    streams_total: int = _limit(4096, "streams open at once across all peers, both directions")
    connection_rate_per_ip: float = _limit(10.0, "new inbound connections per second from one IP address "
                                                 "(refill rate), checked before any byte is read")
    connection_burst_per_ip: int = _limit(50, "new inbound connections from one IP address in a burst")
    refusals_before_ban: int = _limit(200, "refused streams one peer may run into (a burst; 5 more per second "
                                           "are forgiven) before it is disconnected and banned")
    ban_s: float = _limit(60.0, "seconds a banned peer's connections are closed right after its handshake")
    handshake_s: float = _limit(10.0, "seconds an inbound connection may take from its first byte to a "
                                      "finished Noise and Yamux handshake")
    ping_streams_per_peer: int = _limit(8, "ping streams one peer may have open to us at once; more are "
                                           "reset (a client probes each peer once at a time, see probes_in_flight)")
    # -- gossip -------------------------------------------------------------------------------
    gossip_invalid_rate_per_peer: float = _limit(1.0, "gossip messages per second from one peer that may fail "
                                                      "validation (refill rate) before it is muted")
    gossip_invalid_burst_per_peer: int = _limit(20, "invalid gossip messages one peer may send in a burst "
                                                    "before it is muted")
    gossip_mute_s: float = _limit(60.0, "seconds a muted peer's gossip is refused")
    # -- DHT ----------------------------------------------------------------------------------
    dht_requests_per_peer: float = _limit(5.0, "DHT requests per second one peer may send us (refill rate); "
                                                "more get their stream reset")
    dht_burst_per_peer: int = _limit(50, "DHT requests one peer may send in a burst")
    dht_streams_per_peer: int = _limit(8, "DHT request streams one peer may have open at once")
    dht_records: int = _limit(4096, "signed DHT values this node stores for others, in all")
    dht_records_per_peer: int = _limit(64, "signed DHT values this node stores per publishing peer")
    # -- activation sessions (compute peers) ---------------------------------------------------
    activation_frame_bytes: int = _limit(256 << 20, "largest activation frame accepted, bytes (the declared "
                                                    "length is checked before anything is buffered)")
    sessions_per_peer: int = _limit(16, "sessions one upstream peer may hold open on this block at once")
    session_rate_per_peer: float = _limit(20.0, "sessions per second one upstream peer may open (refill rate)")
    session_burst_per_peer: int = _limit(40, "sessions one upstream peer may open in a burst")
    session_idle_s: float = _limit(300.0, "seconds a session may wait for its next step before it expires "
                                          "and frees its KV cache")
    first_frame_s: float = _limit(30.0, "seconds a peer may take to send the first frame of an activation "
                                        "stream (slowloris)")
    # -- weights (peers holding a model's files serve them to peers fetching them) -------------
    weights_streams_per_peer: int = _limit(4, "weight-fetch streams one peer may have open to us at once; more "
                                              "are answered busy")
    weights_mb_per_s: float = _limit(50.0, "megabytes per second this node sends of model weights, to all peers "
                                           "together (so serving weights does not starve inference; set it "
                                           "below your uplink)")
    # -- what this node asks of others (as a client) ------------------------------------------
    sessions_out_per_peer: int = _limit(16, "sessions this node opens to one peer at once (keep it at or below "
                                            "that peer's sessions_per_peer); more requests wait in line")
    probes_in_flight: int = _limit(16, "round-trip probes (pings) this node runs at once; a probe of a peer "
                                       "is shared by every request that needs it")

    def set(self, assignment: str) -> None:
        """Apply one ``NAME=VALUE``."""
        name, sep, value = assignment.partition("=")
        name = name.strip().replace("-", "_")
        kinds = {f.name: f.type for f in dataclasses.fields(self)}
        if not sep or name not in kinds:
            raise LimitError(f"unknown limit {assignment.partition('=')[0]!r} (see `shardnet limits`)"
                             if sep else f"--limit needs NAME=VALUE, got {assignment!r}")
        kind = int if kinds[name] in (int, "int") else float
        try:
            number = kind(value)
        except ValueError:
            raise LimitError(f"limit {name} needs {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}") from None
        if not number > 0:
            raise LimitError(f"limit {name} must be positive, got {value!r}")
        setattr(self, name, number)

    @staticmethod
    def describe() -> list[tuple[str, object, str]]:
        """(name, default, what it bounds) for every limit, in order."""
        return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(Limits)]


@dataclass
class TokenBuckets:
    """Per-key token buckets (a rate and a burst), pruned so a flood of keys stays bounded."""

    rate: float
    burst: int
    max_keys: int = 4096
    _buckets: dict[object, tuple[float, float]] = field(default_factory=dict)

    def take(self, key: object, now: float | None = None) -> bool:
        """One token for ``key``: False when its bucket is empty."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if len(self._buckets) >= self.max_keys and key not in self._buckets:
            self._prune(now)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - 1.0, now)
        return True

    def retry_after(self, key: object, now: float | None = None) -> float | None:
        """Seconds until ``key``'s bucket holds a token again (0: it does now; None: it never
        refills, at a rate of 0)."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            return 0.0
        return (1.0 - tokens) / self.rate if self.rate > 0 else None

    def _prune(self, now: float) -> None:
        # a bucket that has refilled completely carries no state worth keeping
        full = [k for k, (t, last) in self._buckets.items() if t + (now - last) * self.rate >= self.burst]
        for k in full:
            del self._buckets[k]
        if len(self._buckets) >= self.max_keys:  # still full: forget the oldest half
            for k in sorted(self._buckets, key=lambda k: self._buckets[k][1])[: self.max_keys // 2]:
                del self._buckets[k]


#: every refusal in this process by kind, whichever Refusals noted it (metrics report these: a
#: deployed process runs one node, and many refusals are noted by module-wide instances)
REFUSED: Counter[str] = Counter()


class ThrottledLog:
    """Log lines of a kind without flooding the log: the first for a key at once, then at most
    one line per 10 s with the count of those left out since."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, *, most_keys: int = 4096) -> None:
        self.logger, self.level, self.most_keys = logger, level, most_keys
        self._unlogged: Counter[object] = Counter()
        self._last: dict[object, float] = {}

    def log(self, key: object, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -10.0) < 10.0:
            self._unlogged[key] += 1
            return
        if len(self._last) > self.most_keys:
            self._last.clear()
            self._unlogged.clear()
        more = self._unlogged.pop(key, 0)
        self._last[key] = now
        self.logger.log(self.level, "%s%s", message, f" ({more} more like it since the last line)" if more else "")


class Refusals:
    """Counts refusals (of a limit, of bad input) by kind and logs them without flooding the
    log (one line per kind and peer every 10 s at most: ThrottledLog)."""

    def __init__(self, logger: logging.Logger = log, level: int = logging.WARNING) -> None:
        self.counts: Counter[str] = Counter()
        self._log = ThrottledLog(logger, level)

    def note(self, kind: str, peer: object, message: str) -> None:
        self.counts[kind] += 1
        REFUSED[kind] += 1
        self._log.log((kind, str(peer)), message)


class PeerCounts(Counter):
    """How many of something (streams, sessions) each peer holds open; a peer whose count falls
    to zero leaves the table, so it never grows with peers that have come and gone."""

    def release(self, peer: object) -> None:
        self[peer] -= 1
        if self[peer] <= 0:
            del self[peer]


class ConnectionGate:
    """Admits inbound connections within ``connection_rate_per_ip`` / ``connection_burst_per_ip``
    (a stranger's connections cost a handshake each before it has to prove anything)."""

    def __init__(self, limits: Limits, refusals: Refusals | None = None) -> None:
        self.limits = limits
        self.rate = TokenBuckets(limits.connection_rate_per_ip, limits.connection_burst_per_ip)
        self.refusals = refusals or Refusals()

    def admit(self, ip: str) -> bool:
        if self.rate.take(ip):
            return True
        self.refusals.note("connection_rate_per_ip", ip, f"limit connection_rate_per_ip: {ip} connects faster "
                                                         f"than {self.limits.connection_rate_per_ip:g}/s; closing")
        return False


class StreamGate:
    """Admits a peer's inbound streams within ``streams_per_peer`` open at once and
    ``stream_rate_per_peer`` / ``stream_burst_per_peer`` new ones. A peer that keeps running into
    these limits (``refusals_before_ban``) is banned for ``ban_s``: its connections are closed,
    and new ones are closed as soon as their handshake says who it is."""

    def __init__(self, limits: Limits, refusals: Refusals | None = None) -> None:
        self.limits = limits
        self.open = PeerCounts()
        self.rate = TokenBuckets(limits.stream_rate_per_peer, limits.stream_burst_per_peer)
        self.strikes = TokenBuckets(5.0, limits.refusals_before_ban)
        self.banned_until: dict[object, float] = {}
        self.refusals = refusals or Refusals()

    def admit(self, peer: object) -> bool:
        if self.open[peer] >= self.limits.streams_per_peer:
            self._refuse(peer, "streams_per_peer", f"limit streams_per_peer: {short(peer)} has {self.open[peer]} "
                                                   f"streams open; resetting its new ones")
            return False
        if not self.rate.take(peer):
            self._refuse(peer, "stream_rate_per_peer", f"limit stream_rate_per_peer: {short(peer)} opens streams "
                                                       f"faster than {self.limits.stream_rate_per_peer:g}/s; resetting")
            return False
        self.open[peer] += 1
        return True

    def release(self, peer: object) -> None:
        self.open.release(peer)

    def _refuse(self, peer: object, kind: str, message: str) -> None:
        self.refusals.note(kind, peer, message)
        if not self.strikes.take(peer) and not self.is_banned(peer):
            self.banned_until[peer] = time.monotonic() + self.limits.ban_s
            self.refusals.note("ban", peer, f"banning {short(peer)} for {self.limits.ban_s:g} s: "
                                            f"{self.limits.refusals_before_ban} streams refused")

    def is_banned(self, peer: object) -> bool:
        until = self.banned_until.get(peer)
        if until is None:
            return False
        if until <= time.monotonic():
            del self.banned_until[peer]
            return False
        return True
