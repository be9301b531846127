"""Signed receipts of a distributed run, and their offline verification (sans-IO).

A **stage receipt** is what one compute peer signs (its libp2p Ed25519 key) when a session
ends: the model ID, session, layer range, hash chains over the exact wire bytes of every
activation frame it received and sent, the step count, start and end times, its peer ID, the
addresses it saw its neighbours at, its device, the shardnet version, when it applied the LM
head the tokens its logits point to (argmax of each returned row), and what a recomputation
depends on: the dtype it computed in, its weights' quantization, and how many steps it computed in
one forward pass with other sessions' (continuous batching rounds differently from a step alone). It travels as a signed
CBOR envelope (``transport/envelope``), so any change to any field breaks the signature.

A **run receipt** is what the client signs: the prompt's hash, the output token ids and their
hash, the sampling settings and seed, every session of the run (more than one when the chain
healed) with the chains the client itself computed over what it sent and received and each
stage's receipt, the round trips it measured, tokens per second, and for speculative runs
whether greedy speculative output was checked against plain decoding. It is written as JSON
(readable) whose ``body`` is signed as canonical CBOR.

``verify_run`` checks, in order, and names the first failure: the run signature; each stage's
signature, signer and fields; that each session's layer ranges tile the model with no gap or
overlap; that the hash chains link client -> stage 1 -> ... -> stage n -> client; the output
hash; the head's committed tokens; the model ID against a manifest.

Signing and verifying use py-libp2p's keys and peer IDs, imported inside the functions that sign
and verify: importing this module (the receipt types, ``sha256_hex``) loads no network stack.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from shardnet.errors import ShardnetError

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair

SCHEMA = 1
STAGE_DOMAIN = b"shardnet-stage-receipt/1"
RUN_DOMAIN = b"shardnet-run-receipt/1"
MAX_STAGE_BYTES = 64 * 1024
MAX_RUN_BYTES = 16 << 20
ZERO = "00" * 32


class ReceiptError(ShardnetError, ValueError):
    """A receipt is malformed or its signature does not verify."""

    code = "receipt"


class HashChain:
    """h_0 = 32 zero bytes; h_i = sha256(h_{i-1} || sha256(frame_i)). Order and content both count."""

    def __init__(self) -> None:
        self.head = bytes(32)
        self.count = 0

    def add(self, frame: bytes) -> None:
        self.head = hashlib.sha256(self.head + hashlib.sha256(frame).digest()).digest()
        self.count += 1

    def hex(self) -> str:
        return self.head.hex()


def chain_of(frames: list[bytes]) -> str:
    c = HashChain()
    for f in frames:
        c.add(f)
    return c.hex()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokens_hash(ids: list[int]) -> str:
    return sha256_hex(json.dumps(list(ids), separators=(",", ":")).encode())


@dataclass
class StageReceipt:
    model: str
    session: str  # hex
    layers: list[int]  # [start, end)
    in_chain: str
    out_chain: str
    steps_in: int
    steps_out: int
    t_start: float
    t_end: float
    peer: str
    observed: dict[str, str]  # "upstream"/"downstream" -> the address seen
    device: dict[str, str]
    version: str
    tokens: list[int] | None = None  # argmax of each returned logits row, when it applied the head
    schema: int = SCHEMA
    # What a recomputation of the session depends on (absent from receipts before these fields:
    # None there, and a verifier then allows bfloat16's tolerance):
    dtype: str | None = None  # what the block computed in ("float16", ...)
    quant: str | None = None  # its weights' quantization ("none", "int8", ...), as its claim says
    batched_steps: int | None = None  # steps computed in one forward pass with other sessions'
    # Where it ran, as the peer states it (signed; not proven): the region its operator declared
    # (`join --region`), and the GPU's UUID where it computed on CUDA (absent on a CPU)
    region: str | None = None
    gpu_uuid: str | None = None


#: the fields a stage receipt may carry beyond the first schema's, with their types; a reader
#: ignores fields it does not know (a newer peer's), which stay covered by the signature
OPTIONAL_FIELDS = {"dtype": str, "quant": str, "batched_steps": int, "region": str, "gpu_uuid": str}
MAX_REGION = 64


def region_problem(region: str) -> str | None:
    """Why ``region`` cannot be an operator's declared region (None when it can): printable text
    of 1 to ``MAX_REGION`` characters, no line breaks."""
    if not region or len(region) > MAX_REGION:
        return f"a region is 1 to {MAX_REGION} characters"
    if not region.isprintable():
        return "a region is printable text on one line"
    return None


def encode_stage(key_pair: KeyPair, r: StageReceipt) -> bytes:
    from libp2p.peer.id import ID

    from shardnet.transport import envelope

    if str(ID.from_pubkey(key_pair.public_key)) != r.peer:
        raise ReceiptError("a stage receipt must be signed by the peer it names")
    return envelope.seal(key_pair, domain=STAGE_DOMAIN, version=SCHEMA, body=asdict(r), max_bytes=MAX_STAGE_BYTES,
                         error=ReceiptError, what="stage receipt")


def decode_stage(blob: bytes) -> StageReceipt:
    from libp2p.peer.id import ID

    from shardnet.transport import envelope

    body, pk = envelope.open_envelope(blob, domain=STAGE_DOMAIN, version=SCHEMA, max_bytes=MAX_STAGE_BYTES,
                                      error=ReceiptError, what="stage receipt")
    known = {f.name for f in fields(StageReceipt)}
    try:
        r = StageReceipt(**{k: v for k, v in body.items() if k in known})
    except TypeError as e:
        raise ReceiptError(f"stage receipt fields: {e}") from None
    ok = (isinstance(r.layers, list) and len(r.layers) == 2 and all(isinstance(x, int) for x in r.layers)
          and 0 <= r.layers[0] < r.layers[1] and isinstance(r.session, str) and isinstance(r.model, str)
          and isinstance(r.in_chain, str) and isinstance(r.out_chain, str) and isinstance(r.peer, str)
          and isinstance(r.observed, dict) and isinstance(r.device, dict)
          and (r.tokens is None or (isinstance(r.tokens, list) and all(isinstance(t, int) for t in r.tokens)))
          and all(getattr(r, k) is None or isinstance(getattr(r, k), t) for k, t in OPTIONAL_FIELDS.items()))
    if not ok:
        raise ReceiptError("stage receipt fields have the wrong types")
    if str(ID.from_pubkey(pk)) != r.peer:
        raise ReceiptError("stage receipt is signed by a key other than its peer's")
    return r


def receipt_id(blob: bytes) -> str:
    return sha256_hex(blob)


# -- run receipts ----------------------------------------------------------------------------------

@dataclass
class SessionRecord:
    """One chain's session as the client saw it."""

    session: str
    sent_chain: str  # over the frames the client sent to the first hop
    received_chain: str  # over the frames the client received from the last hop
    stages: list[str] = field(default_factory=list)  # base64 stage receipt envelopes, chain order


def seal_run(key_pair: KeyPair, body: dict) -> dict:
    """The run receipt as a JSON-ready dict: {v, body, pk, sig} (hex)."""
    from shardnet.transport import envelope

    blob = envelope.seal(key_pair, domain=RUN_DOMAIN, version=SCHEMA, body=body, max_bytes=MAX_RUN_BYTES,
                         error=ReceiptError, what="run receipt")
    import cbor2

    m = cbor2.loads(blob)
    return {"v": SCHEMA, "body": body, "pk": m["pk"].hex(), "sig": m["sig"].hex()}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def verify_run(doc: Any, *, manifest_model_id: str | None = None) -> list[Check]:
    """Every check, in order; verification stops at the first that fails (later ones need it)."""
    checks: list[Check] = []

    def check(name: str, ok: bool, detail: str) -> bool:
        checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    import cbor2
    from libp2p.crypto.serialization import deserialize_public_key
    from libp2p.peer.id import ID

    try:
        body, pk_hex, sig_hex = doc["body"], doc["pk"], doc["sig"]
        pk = deserialize_public_key(bytes.fromhex(pk_hex))
        signed = pk.verify(cbor2.dumps([RUN_DOMAIN, body], canonical=True), bytes.fromhex(sig_hex))
    except Exception as e:  # any shape problem is a failed signature check, named
        check("run signature", False, f"unreadable run receipt ({type(e).__name__}: {e})")
        return checks
    if not check("run signature", signed and doc.get("v") == SCHEMA and body.get("schema") == SCHEMA,
                 f"signed by client {ID.from_pubkey(pk)}" if signed else "signature does not verify"):
        return checks
    if not check("client", body.get("client") == str(ID.from_pubkey(pk)), "the client field names the signer"):
        return checks
    model, n_layers = body.get("model"), body.get("num_layers")
    sessions = body.get("sessions") or []
    if not check("sessions", isinstance(sessions, list) and sessions and isinstance(n_layers, int),
                 f"{len(sessions)} session(s) over {n_layers} layers"):
        return checks
    for si, sess in enumerate(sessions):
        where = f"session {si + 1}"
        stages = []
        for i, b64 in enumerate(sess.get("stages", [])):
            try:
                st = decode_stage(base64.b64decode(b64, validate=True))
            except (ReceiptError, ValueError) as e:
                check(f"{where} stage {i + 1} signature", False, str(e))
                return checks
            stages.append(st)
        if not check(f"{where} stage signatures", bool(stages), f"{len(stages)} stage receipt(s), all signed by "
                     "the peers they name" if stages else "no stage receipts"):
            return checks
        for i, st in enumerate(stages):
            if not check(f"{where} stage {i + 1} model", st.model == model, f"{st.model[:16]}… vs run {model[:16]}…"):
                return checks
            if not check(f"{where} stage {i + 1} session", st.session == sess.get("session"),
                         f"{st.session} vs {sess.get('session')}"):
                return checks
            seen = stages[i - 1].observed.get("downstream") if i else None
            problem = _place_problem(st)
            if not check(f"{where} stage {i + 1} place", problem is None, problem or _place(st, seen)):
                return checks
        spans = [tuple(st.layers) for st in stages]
        tiled = spans[0][0] == 0 and spans[-1][1] == n_layers and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        if not check(f"{where} layer ranges", tiled, f"{spans} {'tile' if tiled else 'do not tile'} 0:{n_layers}"):
            return checks
        links = [("client -> stage 1", sess.get("sent_chain"), stages[0].in_chain)]
        links += [(f"stage {i + 1} -> stage {i + 2}", a.out_chain, b.in_chain)
                  for i, (a, b) in enumerate(zip(stages, stages[1:]))]
        links.append((f"stage {len(stages)} -> client", stages[-1].out_chain, sess.get("received_chain")))
        for name, a, b in links:
            if not check(f"{where} hash chain {name}", a == b and a is not None,
                         "equal" if a == b else f"{str(a)[:16]}… != {str(b)[:16]}…"):
                return checks
        head_tokens = stages[-1].tokens
        if head_tokens is not None and si == len(sessions) - 1 and body.get("sampling", {}).get("temperature") == 0:
            out = body.get("output_ids", [])
            # the head's argmax over the rows it returned; the last session produced the output's tail
            if not check(f"{where} head tokens", _is_consistent(head_tokens, out),
                         "the tokens the head peer committed to agree with the output"):
                return checks
    out_ids = body.get("output_ids")
    if not check("output hash", isinstance(out_ids, list) and tokens_hash(out_ids) == body.get("output_sha256"),
                 "output_sha256 is the hash of output_ids"):
        return checks
    if manifest_model_id is not None:
        check("model ID", model == manifest_model_id, f"run {str(model)[:16]}… vs manifest {manifest_model_id[:16]}…")
    return checks


def _place_problem(st: StageReceipt) -> str | None:
    """Whether a stage's signed statements of where it ran agree with each other."""
    if st.region is not None and region_problem(st.region):
        return f"region {st.region!r}: {region_problem(st.region)}"
    kind, uuid = st.device.get("kind"), st.device.get("uuid")
    if st.gpu_uuid is not None:
        if kind != "cuda":
            return f"a GPU UUID on a {kind or 'unnamed'} device"
        if uuid and uuid != st.gpu_uuid:
            return f"gpu_uuid {st.gpu_uuid} differs from the device's UUID {uuid}"
    return None


def _place(st: StageReceipt, seen: str | None) -> str:
    """Where a stage says it ran, next to where its upstream neighbour saw it."""
    region = f"region {st.region!r} (declared)" if st.region else "no region declared"
    address = f"seen at {seen} by the stage before" if seen else "address not observed by a signer (first stage)"
    gpu = f"GPU {st.gpu_uuid}" if st.gpu_uuid else f"{st.device.get('kind', '?')} {st.device.get('name', '')}".strip()
    return f"layers {st.layers[0]}:{st.layers[1]} by {st.peer[:16]}…: {region}, {address}; {gpu}"


def _is_consistent(head_tokens: list[int], output: list[int]) -> bool:
    """Each output token is the head's argmax at its position: the output's last tokens appear,
    in order, among what the head returned (with speculation it returns more rows than kept)."""
    it = iter(head_tokens)
    tail = output[-min(len(output), len(head_tokens)):]
    return all(any(t == h for h in it) for t in tail)
