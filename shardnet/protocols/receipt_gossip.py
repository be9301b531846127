"""``/shardnet/receipt-gossip/1.0.0``: receipt digests on gossip, full receipts on request (sans-IO).

A peer keeps the stage receipts it signed in a bounded store and publishes a digest of each on
the gossipsub topic ``/shardnet/receipt-gossip/1.0.0/digests``; anyone fetches full receipts by
ID (or all of a session's) over this protocol's stream: the asker writes a 4-byte big-endian
length and the request, the peer answers with one response and closes. Messages are CBOR maps
with ``v`` = 1:

    request   {v, get: [receipt IDs]} | {v, session: hex} | {v, list: max} | {v, reports: max}
    response  {v, receipts: [stage receipt envelopes]} | {v, digests: [digest]}
              | {v, reports: [report envelopes heard on gossip]} | {v, error: text}
    digest    {v, id, peer, model, session, layers: [start, end], steps, t_end, ?region, ?gpu_uuid}

A receipt's ID is the SHA-256 of its envelope bytes, so a fetched receipt is checked against
the ID it was asked by. Sizes and counts are bounded before anything is kept.

A client that catches a peer computing wrong (an honest-compute check: the same step re-run
on other peers of that span disagrees with it, and a third agrees with the others) publishes
a **report** on ``/shardnet/receipt-gossip/1.0.0/reports``: an envelope signed by the reporter
(domain ``shardnet-audit-report/1``) whose body is

    {schema, model, accused, layers: [start, end], reporter, session (the accused's), step_pos,
     divergence, tolerance, witnesses: [{peer, session, divergence}], evidence: [stage receipt
     envelopes: the accused's for its session, each witness's for the audit session], t}

Receivers check every signature and that the evidence is signed by the peers it names. A report
is one client's word plus the peers' own signed statements of what they served; it is not a
proof a third party can recompute (the frames are not in it), so receivers weigh it, they do
not act on it as on their own observation.

Signing and verifying reports use py-libp2p's keys and peer IDs, imported inside
``encode_report`` and ``decode_report``: importing this module loads no network stack.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import cbor2

from shardnet.errors import ShardnetError

from .receipts import MAX_STAGE_BYTES, ReceiptError, StageReceipt, decode_stage, receipt_id

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair

PROTOCOL_ID = "/shardnet/receipt-gossip/1.0.0"
TOPIC = f"{PROTOCOL_ID}/digests"
REPORT_TOPIC = f"{PROTOCOL_ID}/reports"
REPORT_DOMAIN = b"shardnet-audit-report/1"
VERSION = 1
MAX_EVIDENCE = 4
MAX_REPORT_BYTES = MAX_EVIDENCE * (MAX_STAGE_BYTES + 64) + 16 * 1024
MAX_REPORTS_PER_RESPONSE = 8
MAX_IDS_PER_REQUEST = 64
MAX_RESPONSE_BYTES = MAX_IDS_PER_REQUEST * (MAX_STAGE_BYTES + 64)  # (8 reports fit too)
MAX_REQUEST_BYTES = 16 * 1024
MAX_REPORTS_KEPT = 256  # reports are rare (one per conviction): this is weeks of them


class GossipError(ShardnetError, ValueError):
    """A misbehaviour report is malformed or its signature does not verify."""

    code = "gossip"


def _load(data: bytes, limit: int, what: str) -> dict:
    if len(data) > limit:
        raise GossipError(f"{what} of {len(data)} bytes exceeds {limit}")
    try:
        m = cbor2.loads(data)
    except Exception as e:
        raise GossipError(f"{what} is not CBOR ({e})") from None
    if not isinstance(m, dict) or m.get("v") != VERSION:
        raise GossipError(f"{what} is not a version-{VERSION} map")
    return m


def encode_request(*, get: list[str] | None = None, session: str | None = None, list_max: int | None = None,
                   reports_max: int | None = None) -> bytes:
    if reports_max is not None:
        return cbor2.dumps({"v": VERSION, "reports": min(reports_max, MAX_REPORTS_PER_RESPONSE)})
    if get is not None:
        return cbor2.dumps({"v": VERSION, "get": list(get)[:MAX_IDS_PER_REQUEST]})
    if session is not None:
        return cbor2.dumps({"v": VERSION, "session": session})
    return cbor2.dumps({"v": VERSION, "list": min(list_max or MAX_IDS_PER_REQUEST, MAX_IDS_PER_REQUEST)})


def decode_request(data: bytes) -> tuple[str, object]:
    m = _load(data, MAX_REQUEST_BYTES, "request")
    if isinstance(m.get("get"), list) and all(isinstance(x, str) for x in m["get"]):
        return "get", m["get"][:MAX_IDS_PER_REQUEST]
    if isinstance(m.get("session"), str):
        return "session", m["session"]
    if isinstance(m.get("list"), int) and not isinstance(m["list"], bool):
        return "list", max(0, min(m["list"], MAX_IDS_PER_REQUEST))
    if isinstance(m.get("reports"), int) and not isinstance(m["reports"], bool):
        return "reports", max(0, min(m["reports"], MAX_REPORTS_PER_RESPONSE))
    raise GossipError("request must be get, session, list or reports")


def encode_response(*, receipts: list[bytes] | None = None, digests: list[dict] | None = None,
                    reports: list[bytes] | None = None, error: str | None = None) -> bytes:
    if error is not None:
        return cbor2.dumps({"v": VERSION, "error": error})
    if reports is not None:
        return cbor2.dumps({"v": VERSION, "reports": list(reports)[:MAX_REPORTS_PER_RESPONSE]})
    if digests is not None:
        return cbor2.dumps({"v": VERSION, "digests": digests})
    return cbor2.dumps({"v": VERSION, "receipts": list(receipts or [])})


def decode_response(data: bytes) -> dict:
    m = _load(data, MAX_RESPONSE_BYTES, "response")
    if isinstance(m.get("error"), str):
        raise GossipError(f"peer answered: {m['error']}")
    if isinstance(m.get("receipts"), list) and all(isinstance(b, bytes) for b in m["receipts"]):
        return {"receipts": m["receipts"][:MAX_IDS_PER_REQUEST]}
    if isinstance(m.get("digests"), list) and all(isinstance(d, dict) for d in m["digests"]):
        return {"digests": m["digests"][:MAX_IDS_PER_REQUEST]}
    if isinstance(m.get("reports"), list) and all(isinstance(b, bytes) for b in m["reports"]):
        return {"reports": m["reports"][:MAX_REPORTS_PER_RESPONSE]}
    raise GossipError("response has no receipts, digests or reports")


def digest_of(blob: bytes, r: StageReceipt) -> dict:
    d = {"v": VERSION, "id": receipt_id(blob), "peer": r.peer, "model": r.model, "session": r.session,
         "layers": list(r.layers), "steps": r.steps_in, "t_end": r.t_end}
    # where the peer says it ran (only when stated: older digests stay as they were)
    d |= {k: getattr(r, k) for k in ("region", "gpu_uuid") if getattr(r, k) is not None}
    return d


class ReceiptStore:
    """The newest ``capacity`` receipts, by ID and by session (sans-IO)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._by_id: OrderedDict[str, tuple[bytes, StageReceipt]] = OrderedDict()

    def add(self, blob: bytes) -> str:
        try:
            r = decode_stage(blob)
        except ReceiptError as e:
            raise GossipError(f"not a valid stage receipt: {e}") from None
        rid = receipt_id(blob)
        self._by_id[rid] = (blob, r)
        self._by_id.move_to_end(rid)
        while len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)
        return rid

    def get(self, rid: str) -> bytes | None:
        entry = self._by_id.get(rid)
        return entry[0] if entry else None

    def for_session(self, session: str) -> list[bytes]:
        return [b for b, r in self._by_id.values() if r.session == session]

    def digests(self, limit: int) -> list[dict]:
        items = list(self._by_id.items())[-limit:] if limit else []
        return [digest_of(b, r) for _, (b, r) in reversed(items)]

    def __len__(self) -> int:
        return len(self._by_id)


# -- reports of peers caught computing wrong ----------------------------------------------------

def encode_report(key_pair: KeyPair, body: dict) -> bytes:
    """Sign a report body (see the module docstring); the reporter field must name the signer."""
    from libp2p.peer.id import ID

    from shardnet.transport import envelope

    if body.get("reporter") != str(ID.from_pubkey(key_pair.public_key)):
        raise GossipError("a report must be signed by the reporter it names")
    if len(body.get("evidence", [])) > MAX_EVIDENCE:
        raise GossipError(f"a report carries at most {MAX_EVIDENCE} receipts")
    return envelope.seal(key_pair, domain=REPORT_DOMAIN, version=VERSION, body=body, max_bytes=MAX_REPORT_BYTES,
                         error=GossipError, what="report")


def decode_report(blob: bytes) -> dict:
    """The verified report body; its evidence decoded to StageReceipts under ``receipts``."""
    from libp2p.peer.id import ID

    from shardnet.transport import envelope

    body, pk = envelope.open_envelope(blob, domain=REPORT_DOMAIN, version=VERSION, max_bytes=MAX_REPORT_BYTES,
                                      error=GossipError, what="report")
    if body.get("reporter") != str(ID.from_pubkey(pk)):
        raise GossipError("report is signed by a key other than its reporter's")
    shapes = {"model": str, "accused": str, "session": str, "divergence": float, "tolerance": float,
              "witnesses": list, "evidence": list, "layers": list}
    for name, kind in shapes.items():
        if not isinstance(body.get(name), kind):
            raise GossipError(f"report field {name!r} is missing or not a {kind.__name__}")
    if len(body["evidence"]) > MAX_EVIDENCE or not all(isinstance(b, bytes) for b in body["evidence"]):
        raise GossipError(f"report evidence must be at most {MAX_EVIDENCE} receipt envelopes")
    if body["accused"] == body["reporter"]:
        raise GossipError("a reporter cannot accuse itself")
    receipts = []
    for blob_i in body["evidence"]:
        try:
            receipts.append(decode_stage(blob_i))
        except ReceiptError as e:
            raise GossipError(f"report evidence: {e}") from None
    named = {body["accused"]} | {w.get("peer") for w in body["witnesses"] if isinstance(w, dict)}
    for r in receipts:
        if r.peer not in named or r.model != body["model"]:
            raise GossipError(f"report evidence from {r.peer[:16]}… is not about this report's peers and model")
    if not any(r.peer != body["accused"] for r in receipts):
        raise GossipError("a report needs at least one witness's signed receipt")
    return dict(body, receipts=receipts)


class ReportLog:
    """The reports heard on gossip (sans-IO): only verified ones, each once (by report ID, the
    SHA-256 of its envelope), the newest ``capacity``; the oldest heard is dropped first."""

    def __init__(self, capacity: int = MAX_REPORTS_KEPT) -> None:
        self.capacity = capacity
        self.reports: OrderedDict[str, dict] = OrderedDict()  # report ID -> verified body, oldest first
        self.blobs: OrderedDict[str, bytes] = OrderedDict()  # report ID -> its envelope, same order

    def add(self, blob: bytes) -> tuple[str, dict] | None:
        """Verify and keep a report; its ID and body when it is new, None when already kept.
        GossipError when it does not verify (nothing is kept)."""
        report = decode_report(blob)
        rid = receipt_id(blob)
        if rid in self.reports:
            return None
        self.reports[rid], self.blobs[rid] = report, blob
        while len(self.reports) > self.capacity:
            self.reports.popitem(last=False)
            self.blobs.popitem(last=False)
        return rid, report

    def newest(self, limit: int) -> list[bytes]:
        """The envelopes of the ``limit`` newest reports, newest first."""
        return list(reversed(self.blobs.values()))[:limit]

    def __contains__(self, rid: object) -> bool:
        return rid in self.reports

    def __len__(self) -> int:
        return len(self.reports)
