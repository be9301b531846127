"""``/shardnet/receipt-gossip/1.0.0``: receipt digests on gossip, full receipts on request (sans-IO).

A peer keeps the stage receipts it signed in a bounded store and publishes a digest of each on
the gossipsub topic ``/shardnet/receipt-gossip/1.0.0/digests``; anyone fetches full receipts by
ID (or all of a session's) over this protocol's stream: the asker writes a 4-byte big-endian
length and the request, the peer answers with one response and closes. Messages are CBOR maps
with ``v`` = 1:

    request   {v, get: [receipt IDs]} | {v, session: hex} | {v, list: max}
    response  {v, receipts: [stage receipt envelopes]} | {v, digests: [digest]} | {v, error: text}
    digest    {v, id, peer, model, session, layers: [start, end], steps, t_end}

A receipt's ID is the SHA-256 of its envelope bytes, so a fetched receipt is checked against
the ID it was asked by. Sizes and counts are bounded before anything is kept.
"""

from __future__ import annotations

from collections import OrderedDict

import cbor2

from .receipts import MAX_STAGE_BYTES, ReceiptError, StageReceipt, decode_stage, receipt_id

PROTOCOL_ID = "/shardnet/receipt-gossip/1.0.0"
TOPIC = f"{PROTOCOL_ID}/digests"
VERSION = 1
MAX_IDS_PER_REQUEST = 64
MAX_RESPONSE_BYTES = MAX_IDS_PER_REQUEST * (MAX_STAGE_BYTES + 64)
MAX_REQUEST_BYTES = 16 * 1024


class GossipError(ValueError):
    pass


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


def encode_request(*, get: list[str] | None = None, session: str | None = None, list_max: int | None = None) -> bytes:
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
    raise GossipError("request must be get, session or list")


def encode_response(*, receipts: list[bytes] | None = None, digests: list[dict] | None = None,
                    error: str | None = None) -> bytes:
    if error is not None:
        return cbor2.dumps({"v": VERSION, "error": error})
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
    raise GossipError("response has neither receipts nor digests")


def digest_of(blob: bytes, r: StageReceipt) -> dict:
    return {"v": VERSION, "id": receipt_id(blob), "peer": r.peer, "model": r.model, "session": r.session,
            "layers": list(r.layers), "steps": r.steps_in, "t_end": r.t_end}


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
