"""``/shardnet/block-claim/1.0.0``: a compute peer's signed claim to serve a layer range (sans-IO).

A claim says: peer P serves layers [start, end) of model M, has room for ``kv_tokens`` tokens
of KV cache, estimates ``tput`` tokens/s, is reachable at ``addrs``, until ``expires`` (Unix
time). Optional fields (absent in older claims): ``reach`` (the peer's AutoNAT verdict:
public, private or unknown), ``load`` (the share of its KV budget in use) and ``rtts``
([peer, seconds] pairs: its measured round trips to peers serving the layers after its own,
which clients use as edge weights when routing), ``dtype`` (what it computes in: clients route
through peers computing in their own dtype, and honest-compute checks allow for it when comparing
peers' outputs) and ``quant`` (how its weights are quantized, "none" when they are not: clients
may require or refuse quantized spans), ``sub_spans`` (true: the peer runs a session over any
layer range within its span, not only the whole span). It is signed with the peer's Ed25519 identity key, so anyone can check it came from P
and was not altered; it travels through the DHT (a signed value, plus a provider record under
the layer range holding its first layer: ``layer_ranges``, ``claim_ranges``), as news on that
range's gossipsub topic ``/shardnet/block-claim/1.0.0/<model>/r<i>`` (``range_topic``; a compute
peer follows its span's ``neighbourhood``), and on this protocol's stream (a peer answers a
request with its current claims). docs/protocols.md, "Claim dissemination", has the rules.

Signing and verifying use py-libp2p's keys and peer IDs, imported inside ``encode`` and ``decode``:
importing this module (the Claim type, the ClaimTable) loads no network stack.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from shardnet.errors import ShardnetError

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair

PROTOCOL_ID = "/shardnet/block-claim/1.0.0"
CLAIM_VERSION = 1
SIGNING_DOMAIN = b"shardnet-block-claim/1"
MAX_CLAIM_BYTES = 16 * 1024


class ClaimError(ShardnetError, ValueError):
    """A claim is malformed, forged or expired."""

    code = "claim"


@dataclass(frozen=True)
class Claim:
    model: str
    start: int
    end: int
    kv_tokens: int
    tput: float
    addrs: tuple[str, ...]
    expires: float
    peer: str
    reach: str = "unknown"
    load: float = 0.0
    rtts: tuple[tuple[str, float], ...] = ()
    dtype: str = "unknown"
    quant: str = "none"
    since: float = 0.0  # when the peer began serving (Unix time; 0: not said), for uptime displays
    #: the span the peer is loading now, to serve once loaded (None: none). A peer that serves
    #: nothing yet claims that span as its own too: ``serving`` is then False, and clients route
    #: through no such claim; placement counts it where the peer will be, so that peers joining
    #: or moving while it loads do not all take the same layers.
    loading: tuple[int, int] | None = None
    #: the claim's version: the publisher raises it whenever what the claim says changes beyond
    #: ``news``'s thresholds (a new span, addresses, a step of load...); a refresh of the same
    #: news keeps it and extends ``expires``. 0: not said (claims from before the key existed).
    seq: int = 0
    #: the peer runs sessions over any layer range within its span (an ``open`` whose ``layers``
    #: are a part of [start, end): a *sub-span* session); False (absent, as in older claims): the
    #: whole span only, and a route may use the peer for [start, end) alone
    sub_spans: bool = False

    def covers(self, layer: int) -> bool:
        return self.start <= layer < self.end

    @property
    def serving(self) -> bool:
        """Whether the peer serves start..end now (not only loading it)."""
        return self.loading != (self.start, self.end)


def topic(model_id: str) -> str:
    """The model-wide topic (dissemination 1: every claim of the model; no longer published on)."""
    return f"{PROTOCOL_ID}/{model_id}"


# -- layer ranges: where a claim is published and looked up (dissemination 2) ---------------------
#: a model's layers fall into at most this many ranges of (nearly) equal size; a claim is gossiped
#: on, and provided under, the range holding its first layer, so a peer hears the claims near its
#: own span and a lookup asks for the ranges it routes through, not the whole swarm's claims
CLAIM_RANGES = 16
#: and ranges hold at least this many layers: a range narrower than a typical span filters no
#: better (a peer follows its whole span's neighbourhood) and only adds a lookup per range
MIN_RANGE_LAYERS = 4


def layer_ranges(num_layers: int) -> list[tuple[int, int]]:
    """The ranges [a, b) that tile 0..num_layers: min(CLAIM_RANGES, num_layers // MIN_RANGE_LAYERS)
    of them (at least one), their sizes differing by at most one layer."""
    n = max(1, min(CLAIM_RANGES, num_layers // MIN_RANGE_LAYERS))
    return [(i * num_layers // n, (i + 1) * num_layers // n) for i in range(n)]


def ranges_of(start: int, end: int, num_layers: int) -> list[int]:
    """The indices of the ranges that layers [start, end) overlap (clipped to the model)."""
    start, end = max(0, start), min(num_layers, end)
    return [i for i, (a, b) in enumerate(layer_ranges(num_layers)) if a < end and start < b]


def claim_ranges(claim: Claim, num_layers: int) -> list[int]:
    """The ranges a claim is published on (gossiped, provided): the one holding its first layer,
    and the one holding the first layer of the span it is loading. A route enters a claim at its
    first layer, and the peers that need it hear it there: its predecessors (whose neighbourhood
    holds the layer after their span) and the peers whose spans hold that layer. So a lookup of
    every range finds every claim once, and a claim spanning many ranges costs one message."""
    firsts = {claim.start} | ({claim.loading[0]} if claim.loading else set())
    return sorted({i for a in firsts for i in ranges_of(a, a + 1, num_layers)})


def neighbourhood(start: int, end: int, num_layers: int) -> list[int]:
    """The ranges a peer serving [start, end) follows: those its span overlaps and the one holding
    the layer after it, so it hears the claims that start inside its span (span-mates, peers a
    move would meet) and at its end (its successors)."""
    return ranges_of(start, end + 1, num_layers)


def range_topic(model_id: str, index: int) -> str:
    """The gossip topic of one layer range of a model (dissemination 2)."""
    return f"{PROTOCOL_ID}/{model_id}/r{index}"


REACH_VALUES = ("public", "private", "unknown")
DTYPE_VALUES = ("float32", "bfloat16", "float16", "int8", "unknown")
QUANT_VALUES = ("none", "int8", "int4")
MAX_RTTS = 16


def _body(c: Claim) -> dict:
    d = asdict(c)
    d["addrs"] = list(c.addrs)
    d["rtts"] = [list(pair) for pair in c.rtts[:MAX_RTTS]]
    if not c.seq:
        del d["seq"]  # absent, as in claims from before the key existed
    if not c.sub_spans:
        del d["sub_spans"]  # absent, as in claims from before the key existed
    if c.loading is None:
        del d["loading"]  # absent, as in claims from before the key existed
    else:
        d["loading"] = list(c.loading)
    return d


def _span(v) -> tuple[int, int] | None:
    if v is None:
        return None
    if (not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or not 0 <= v[0] < v[1]):
        raise ClaimError("claim loading must be a [start, end] layer range")
    return v[0], v[1]


def _rtts(v) -> tuple[tuple[str, float], ...]:
    if not isinstance(v, list) or len(v) > MAX_RTTS:
        raise ClaimError(f"claim rtts must be a list of at most {MAX_RTTS} [peer, seconds] pairs")
    out = []
    for item in v:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], (int, float)) or isinstance(item[1], bool) or not 0 <= item[1] < 3600):
            raise ClaimError("claim rtts must be [peer, seconds] pairs")
        out.append((item[0], float(item[1])))
    return tuple(out)


def encode(key_pair: KeyPair, claim: Claim) -> bytes:
    from libp2p.peer.id import ID

    from shardnet.transport import envelope

    if str(ID.from_pubkey(key_pair.public_key)) != claim.peer:
        raise ClaimError("a claim must be signed by the peer it names")
    return envelope.seal(key_pair, domain=SIGNING_DOMAIN, version=CLAIM_VERSION, body=_body(claim),
                         max_bytes=MAX_CLAIM_BYTES, error=ClaimError, what="claim")


def decode(blob: bytes, *, now: float | None = None) -> Claim:
    """Verify and return the claim; ClaimError naming the first problem otherwise. A claim's
    signature is checked once: the same bytes again (the gossip validator, then the subscriber;
    the same claim from the DHT and a direct request) come from a cache of verified claims, and
    only their expiry is checked again."""
    key = hashlib.blake2b(blob, digest_size=16).digest()
    claim = _verified.get(key)
    if claim is None:
        claim = _verify(blob)
        _verified[key] = claim
        if len(_verified) > VERIFIED_CACHE:
            _verified.popitem(last=False)
    else:
        _verified.move_to_end(key)
    if claim.expires < (time.time() if now is None else now):
        raise ClaimError("claim has expired")
    return claim


#: how many verified claims ``decode`` remembers (by a hash of their bytes), oldest out first
VERIFIED_CACHE = 4096
_verified: OrderedDict[bytes, Claim] = OrderedDict()


class Verifications:
    """How many claim signatures this process has checked (for tests and the profile)."""

    count = 0


def _verify(blob: bytes) -> Claim:
    from libp2p.peer.id import ID

    from shardnet.transport import envelope

    Verifications.count += 1
    body, pk = envelope.open_envelope(blob, domain=SIGNING_DOMAIN, version=CLAIM_VERSION,
                                      max_bytes=MAX_CLAIM_BYTES, error=ClaimError, what="claim")
    try:
        c = Claim(model=body["model"], start=body["start"], end=body["end"], kv_tokens=body["kv_tokens"],
                  tput=float(body["tput"]), addrs=tuple(body["addrs"]), expires=float(body["expires"]),
                  peer=body["peer"], reach=body.get("reach", "unknown"), load=float(body.get("load", 0.0)),
                  rtts=_rtts(body.get("rtts", [])), dtype=body.get("dtype", "unknown"),
                  quant=body.get("quant", "none"), since=float(body.get("since", 0.0)),
                  loading=_span(body.get("loading")), seq=body.get("seq", 0),
                  sub_spans=body.get("sub_spans", False))
    except (KeyError, TypeError, ValueError) as e:
        raise ClaimError(f"claim body incomplete ({e})") from None
    if not (isinstance(c.model, str) and isinstance(c.peer, str) and all(isinstance(a, str) for a in c.addrs)
            and isinstance(c.start, int) and isinstance(c.end, int) and 0 <= c.start < c.end
            and isinstance(c.kv_tokens, int) and c.kv_tokens >= 0 and c.reach in REACH_VALUES
            and c.dtype in DTYPE_VALUES and c.quant in QUANT_VALUES
            and math.isfinite(c.tput) and c.tput >= 0 and 0.0 <= c.load <= 1.0
            and math.isfinite(c.since) and c.since >= 0
            and isinstance(c.seq, int) and not isinstance(c.seq, bool) and 0 <= c.seq < 1 << 63
            and isinstance(c.sub_spans, bool)):
        raise ClaimError("claim body has the wrong types or an empty layer range")
    if str(ID.from_pubkey(pk)) != c.peer:
        raise ClaimError("claim is signed by a key other than its peer's")
    return c


class ClaimTable:
    """The claims one node keeps for one model: at most one per peer, the latest-expiring one
    heard, never one taken expired (sans-IO: the caller passes ``now``, Unix time).

    Claims are ordered by ``(seq, expires)``: a claim of a higher version replaces its peer's
    older one, and so does the same version with a later expiry (a refresh: the peer re-claims
    before its claim runs out); anything else is an old copy still travelling (gossip, a DHT
    replica), so it changes nothing. Claims without a version (``seq`` 0) are ordered by expiry
    alone."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._by_peer: dict[str, Claim] = {}

    def current(self, now: float) -> list[Claim]:
        """The unexpired claims, one per peer; expired ones are dropped here."""
        for peer in [p for p, c in self._by_peer.items() if c.expires <= now]:
            del self._by_peer[peer]
        return list(self._by_peer.values())

    def get(self, peer: str) -> Claim | None:
        """The peer's kept claim (possibly expired since: ``current`` is what drops those)."""
        return self._by_peer.get(peer)

    def note(self, claim: Claim, now: float) -> bool:
        """Take a verified claim; True when it is new or newer than what we had for its peer."""
        if claim.model != self.model_id or claim.expires <= now:
            return False
        old = self._by_peer.get(claim.peer)
        if old is not None and (claim.seq, claim.expires) <= (old.seq, old.expires):
            return False
        self._by_peer[claim.peer] = claim
        return True

    def __len__(self) -> int:
        return len(self._by_peer)


# -- when a claim is news --------------------------------------------------------------------------
#: a claim's load is news when it moves to another of this many steps
LOAD_STEPS = 8
#: tokens/s, free KV tokens and successors' round trips are news when they change by this share
CHANGE_SHARE = 0.25


def news(old: Claim | None, new: Claim) -> str | None:
    """What makes ``new`` news against the claim last published (``old``), or None when it only
    refreshes it: the first claim, another span (served or loading), addresses, reachability,
    dtype or quantization, a start time; successors measured where there were none (or none
    left); load into another of ``LOAD_STEPS`` steps; tokens/s, free KV tokens or the fastest
    successor's round trip changed by ``CHANGE_SHARE`` or more. A publisher raises ``seq`` for news only (sans-IO: both the
    publisher and the swarm simulation call this)."""
    if old is None:
        return "first claim"
    for what in ("model", "start", "end", "loading", "reach", "dtype", "quant", "since"):
        if getattr(old, what) != getattr(new, what):
            return what
    if set(old.addrs) != set(new.addrs):
        return "addrs"
    if int(old.load * LOAD_STEPS) != int(new.load * LOAD_STEPS):
        return "load"
    if _moved(old.tput, new.tput):
        return "tput"
    if _moved(old.kv_tokens, new.kv_tokens):
        return "kv_tokens"
    # successors: only the fastest round trip (what a client's route through us is bounded by)
    # and whether there is one at all; which peers they are changes every upkeep in a large
    # swarm, and as news it was most of the gossip there (docs/scale.md)
    old_best, new_best = min((t for _, t in old.rtts), default=None), min((t for _, t in new.rtts), default=None)
    if (old_best is None) != (new_best is None):
        return "successors"
    if old_best is not None and _moved(old_best, new_best, RTT_FLOOR_S):
        return "rtts"
    return None


#: round trips that change by less than this (seconds) are not news, whatever the share
RTT_FLOOR_S = 0.005


def _moved(old: float, new: float, floor: float = 0.0) -> bool:
    change = abs(new - old)
    return change > floor and change >= CHANGE_SHARE * abs(old) if old else change > floor
