"""``/shardnet/weights/1.0.0``: fetching a model's bytes from the peers that hold them (sans-IO).

A model's manifest names every blob the model is made of (config and tokenizer files, each
tensor) with its size and a *root*: the SHA-256 of its size and the SHA-256 of each of its
fixed-size chunks, in order. The model ID is the hash of the manifest, so one 64-hex ID commits to
every byte of every chunk. A fetcher asks a peer for

- ``have``: which blobs it can serve, as blob-name prefixes (``""``: every blob);
- ``manifest``: a range of the manifest's bytes (checked whole against the model ID);
- ``hashes``: a blob's chunk hashes (checked against the blob's root before any is trusted);
- ``chunk``: chunk *i* of a blob (checked against its hash before it is written anywhere).

So each chunk is verified on arrival, whichever peer sent it: chunks of one blob can come from
several peers at once, a fetch resumes from the chunks already verified, and a peer that sends
one bad chunk is caught at that chunk. Blob names are ``file:<name>``, ``tensor:<name>`` and
``gguf:<name>`` (a GGUF file's header).

On the wire: length-prefixed frames (framing.py) of canonical CBOR. The fetcher sends requests
(up to ``MAX_IN_FLIGHT`` before reading a reply), the server answers each in order with
``{"ok": true, ...}`` or ``{"ok": false, "code": ..., "error": ...}``. ``WeightsClient`` and
``WeightsServer`` below hold every rule (versions, sizes, pairing replies with requests); the
I/O layer only feeds them bytes and sends what they return.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import cbor2

from shardnet.errors import ShardnetError
from shardnet.protocols.framing import FrameDecoder, FrameError, encode_frame

PROTOCOL_ID = "/shardnet/weights/1.0.0"
VERSION = 1
#: every blob is cut into chunks of this many bytes (the last may be shorter): a constant of the
#: protocol, so that every peer's manifest of the same files is the same and so is the model ID
CHUNK_SIZE = 1 << 20
ROOT_DOMAIN = b"shardnet-blob-root/1"
#: the most bytes one ``manifest`` request may ask for
MAX_MANIFEST_RANGE = 4 << 20
MAX_REQUEST_BYTES = 4096
#: a reply carries at most one chunk, a manifest range or a blob's chunk hashes
MAX_REPLY_BYTES = max(CHUNK_SIZE, MAX_MANIFEST_RANGE) + 4096
#: requests a fetcher may send on one stream before reading a reply
MAX_IN_FLIGHT = 8
OPS = ("have", "manifest", "hashes", "chunk")
ERROR_CODES = ("unknown_model", "not_held", "bad_request", "busy", "internal")


class WeightsError(ShardnetError):
    """A weights exchange broke a rule of the protocol (malformed, oversize, out of order)."""

    code = "weights"


class BadChunk(WeightsError):
    """Bytes a peer sent do not match what the manifest commits to."""

    code = "bad_chunk"


# -- content addressing -------------------------------------------------------------------------
def chunk_count(size: int) -> int:
    return max(1, -(-size // CHUNK_SIZE))


def chunk_span(size: int, index: int) -> tuple[int, int]:
    """Byte range [start, end) of chunk ``index`` of a blob of ``size`` bytes."""
    start = index * CHUNK_SIZE
    return start, min(size, start + CHUNK_SIZE)


def chunk_hash(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def blob_root(size: int, hashes: bytes) -> str:
    """The root a manifest records for a blob: its size and its chunks' hashes, hashed."""
    return hashlib.sha256(ROOT_DOMAIN + size.to_bytes(8, "big") + hashes).hexdigest()


class ChunkChecker:
    """Checks one blob's chunks against its root: from its chunk hashes (which must hash to the
    root) or, for a one-chunk blob, from the chunk itself."""

    def __init__(self, name: str, size: int, root: str, hashes: bytes | None = None) -> None:
        self.name, self.size, self.root = name, size, root
        self.count = chunk_count(size)
        self.hashes: bytes | None = None
        if hashes is not None:
            self.set_hashes(hashes)

    @property
    def needs_hashes(self) -> bool:
        return self.hashes is None and self.count > 1

    def set_hashes(self, hashes: bytes) -> None:
        if len(hashes) != 32 * self.count or blob_root(self.size, hashes) != self.root:
            raise BadChunk(f"{self.name}: chunk hashes do not match the manifest's root")
        self.hashes = hashes

    def check(self, index: int, data: bytes) -> None:
        """Raise BadChunk unless ``data`` is chunk ``index`` as the manifest commits to it."""
        if not 0 <= index < self.count:
            raise BadChunk(f"{self.name} has chunks 0..{self.count - 1}, not {index}")
        start, end = chunk_span(self.size, index)
        if len(data) != end - start:
            raise BadChunk(f"{self.name}: chunk {index} has {len(data)} bytes, not {end - start}")
        h = chunk_hash(data)
        if self.count == 1:
            if blob_root(self.size, h) != self.root:
                raise BadChunk(f"{self.name}: its bytes do not match the manifest")
            self.hashes = h
            return
        if self.hashes is None:
            raise WeightsError(f"{self.name}: chunk hashes are needed before chunk {index} can be checked")
        if self.hashes[32 * index: 32 * index + 32] != h:
            raise BadChunk(f"{self.name}: chunk {index} does not match its hash in the manifest")


# -- messages -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    op: str
    model: str
    blob: str = ""
    index: int = 0  # chunk index, or the manifest range's offset
    length: int = 0  # manifest range length

    def to_wire(self) -> dict:
        return {"v": VERSION, "op": self.op, "model": self.model, "blob": self.blob, "index": self.index,
                "length": self.length}


@dataclass(frozen=True)
class Reply:
    ok: bool
    data: bytes = b""  # a chunk, a manifest range, or concatenated chunk hashes
    prefixes: tuple[str, ...] = ()  # for ``have``
    total: int = 0  # for ``manifest``: the manifest's whole size
    code: str = ""
    error: str = ""

    @classmethod
    def failure(cls, code: str, error: str) -> Reply:
        return cls(False, code=code, error=error[:300])

    def to_wire(self) -> dict:
        if not self.ok:
            return {"v": VERSION, "ok": False, "code": self.code, "error": self.error}
        return {"v": VERSION, "ok": True, "data": self.data, "prefixes": list(self.prefixes), "total": self.total}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_request(payload: bytes) -> Request:
    try:
        m = cbor2.loads(payload)
    except Exception as e:
        raise WeightsError(f"weights request is not CBOR: {type(e).__name__}") from None
    if not isinstance(m, dict):
        raise WeightsError("weights request is not a map")
    if m.get("v") != VERSION:
        raise WeightsError(f"weights protocol version {m.get('v')!r} is not supported (this peer speaks {VERSION})")
    op, model, blob, index, length = (m.get(k) for k in ("op", "model", "blob", "index", "length"))
    if op not in OPS:
        raise WeightsError(f"unknown weights op {op!r}")
    if not (isinstance(model, str) and len(model) == 64 and isinstance(blob, str) and len(blob) <= 1024
            and _is_int(index) and index >= 0 and _is_int(length) and length >= 0):
        raise WeightsError(f"malformed weights {op} request")
    if op == "manifest" and not 0 < length <= MAX_MANIFEST_RANGE:
        raise WeightsError(f"manifest range of {length} bytes is outside 1..{MAX_MANIFEST_RANGE}")
    return Request(op, model, blob, index, length)


def parse_reply(payload: bytes) -> Reply:
    try:
        m = cbor2.loads(payload)
    except Exception as e:
        raise WeightsError(f"weights reply is not CBOR: {type(e).__name__}") from None
    if not isinstance(m, dict) or m.get("v") != VERSION:
        raise WeightsError("weights reply is not a version-1 map")
    if m.get("ok") is False:
        code, error = m.get("code"), m.get("error")
        if not isinstance(code, str) or not isinstance(error, str):
            raise WeightsError("malformed weights error reply")
        return Reply.failure(code, error)
    data, prefixes, total = m.get("data"), m.get("prefixes"), m.get("total")
    if m.get("ok") is not True or not isinstance(data, bytes) or not _is_int(total) or total < 0 or \
            not isinstance(prefixes, list) or len(prefixes) > 4096 or not all(isinstance(p, str) for p in prefixes):
        raise WeightsError("malformed weights reply")
    return Reply(True, data=data, prefixes=tuple(prefixes), total=total)


# -- the two ends of a stream ---------------------------------------------------------------------
class WeightsClient:
    """The fetcher's end: requests go out in order, replies are paired with them in order."""

    def __init__(self) -> None:
        self._decoder = FrameDecoder(MAX_REPLY_BYTES)
        self._outstanding: deque[Request] = deque()

    @property
    def in_flight(self) -> int:
        return len(self._outstanding)

    def send(self, request: Request) -> bytes:
        if len(self._outstanding) >= MAX_IN_FLIGHT:
            raise WeightsError(f"at most {MAX_IN_FLIGHT} weights requests may be in flight on a stream")
        frame = _frame(cbor2.dumps(request.to_wire(), canonical=True), MAX_REQUEST_BYTES)
        self._outstanding.append(request)  # only once it can be sent
        return frame

    def receive_data(self, data: bytes) -> list[tuple[Request, Reply]]:
        out = []
        for payload in _frames(self._decoder, data):
            if not self._outstanding:
                raise WeightsError("weights reply without a request")
            request = self._outstanding.popleft()
            reply = parse_reply(payload)
            if reply.ok:
                _check_reply_fits(request, reply)
            out.append((request, reply))
        return out

    def end_of_stream(self) -> None:
        if self._outstanding or self._decoder.pending:
            raise WeightsError(f"the peer closed the stream with {len(self._outstanding)} weights requests unanswered")


def _check_reply_fits(request: Request, reply: Reply) -> None:
    if request.op == "chunk" and len(reply.data) > CHUNK_SIZE:
        raise WeightsError(f"chunk reply of {len(reply.data)} bytes is larger than a chunk")
    if request.op == "manifest" and len(reply.data) > request.length:
        raise WeightsError("manifest reply is longer than the range asked for")


class WeightsServer:
    """The serving end: requests in, at most ``MAX_IN_FLIGHT`` unanswered; replies out in order."""

    def __init__(self) -> None:
        self._decoder = FrameDecoder(MAX_REQUEST_BYTES)
        self._pending: deque[Request] = deque()

    def receive_data(self, data: bytes) -> list[Request]:
        """The requests that ``data`` completes, in order; each must be answered with ``send``."""
        new = []
        for payload in _frames(self._decoder, data):
            if len(self._pending) >= MAX_IN_FLIGHT:
                raise WeightsError(f"more than {MAX_IN_FLIGHT} weights requests in flight on one stream")
            request = parse_request(payload)
            self._pending.append(request)
            new.append(request)
        return new

    def send(self, reply: Reply) -> bytes:
        if not self._pending:
            raise WeightsError("a weights reply needs a request to answer")
        frame = _frame(cbor2.dumps(reply.to_wire(), canonical=True), MAX_REPLY_BYTES)
        self._pending.popleft()
        return frame


def _frame(payload: bytes, limit: int) -> bytes:
    try:
        return encode_frame(payload, limit)
    except FrameError as e:
        raise WeightsError(f"weights message too large: {e}") from None


def _frames(decoder: FrameDecoder, data: bytes) -> list[bytes]:
    try:
        return decoder.feed(data)
    except FrameError as e:
        raise WeightsError(f"weights stream: {e}") from None
