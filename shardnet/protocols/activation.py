"""``/shardnet/activation/1.0.0``: activations streamed through a chain of blocks (sans-IO).

Wire format: a sequence of frames. Each frame is

    u32 frame_length | u32 header_length | CBOR header | raw tensor bytes (possibly empty)

(big-endian lengths). The header is a CBOR map with ``v`` (message version, 1), ``t`` (type)
and ``s`` (16-byte session ID), plus per type:

    open    model (hex model ID), layers [start, end], max_len, chain [{peer, addrs, layers}...]
            (the hops after the receiver), ret {peer, addrs} (where the last hop returns),
            logits (bool: the last hop applies norm + LM head and returns logits),
            wire (optional: dtype every hop sends hidden states in: float32, float16, bfloat16,
            or int8q = int8 with a float32 scale per position),
            prefix (optional: a scope of at most 64 characters; each hop may reuse the keys and
            values it cached for the same inputs in that scope instead of computing them again:
            "shared" is one scope for every client, any other value is private to ``ret.peer``)
    ready   tree (optional, default false: every hop from the sender to the chain's end takes
            tree steps; a hop says so only when it does and its next hop's ready said so)
    attach  -                        (last hop -> client, first frame of the return stream)
    step    n (step number), pos (first position), dtype, shape   + tensor bytes
            pos may be below the receiver's cache length: the cache is first cut back to pos
            (rollback after rejected speculation); logits_for (optional, default 1): how many
            final positions the last hop returns logits for, when it holds the LM head;
            e (optional, default 0): speculation epoch. Step numbers only increase but may skip:
            a peer drops a chunk when a step of a newer epoch is already queued behind it;
            tree (optional; only to a chain whose ready said tree): the step's tokens are a tree
            of drafts (at most MAX_TREE_TOKENS, 256): tree[i] is token i's parent among them (-1:
            the cached text; parents come first); token i sits at position pos + its depth and
            attends to the cache and its ancestors; the cache holds the whole tree (in the given
            order) after the step, and the next step starts at most one past the tree's first
            token unless it keeps a path;
            keep (optional): before this step, the cached positions keep[0] < keep[1] < ... are
            moved to keep[0], keep[0] + 1, ... and the cache is cut after them (the accepted path
            of a tree step; then pos may be up to keep[0] + len(keep)). A step that keeps is
            never dropped as fenced off
    result  n, pos, dtype, shape, kind ("hidden" | "logits")      + tensor bytes
    close   -
    error   code (an ``ErrorCode`` value), msg, n (optional), peer (optional: the peer that failed,
            named by the hop that saw it fail, so a client can replace exactly that peer); a
            refusal that waiting may cure also carries (optional) need_bytes and limit_bytes
            (kv_budget: the session's KV cache and the block's whole budget) or retry_after_s
            (rate_limited: when the peer's session rate lets another in). A peer that leaves
            them out (an older one) is read as giving no figures; a field of the wrong type
            is ignored like an unknown one

Tensors are never pickled: a dtype name, a shape, and the little-endian element bytes, whose
length must equal prod(shape) * itemsize. Everything is checked before a message is returned;
a bad frame raises ``ActivationProtocolError`` with a code and a message naming the problem.

Each message type is a frozen dataclass (``Open``, ``Ready``, ``Attach``, ``Step``, ``Result``,
``Close``, ``Error``); ``encode`` writes the header keys in a fixed order and leaves optional
fields out at their defaults, so a message encodes to the same bytes every time (receipts hash
frames). The session rules live in ``activation_session.py``; the trio driver in
``activation_io.py``.
"""

from __future__ import annotations

import enum
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar

import cbor2

from shardnet.errors import ShardnetError

from .framing import FrameDecoder, FrameError, encode_frame

PROTOCOL_ID = "/shardnet/activation/1.0.0"
MESSAGE_VERSION = 1
SESSION_ID_BYTES = 16
#: the longest prefix reuse scope an open may name
MAX_PREFIX_SCOPE = 64
DEFAULT_MAX_FRAME = 256 << 20
#: the most tokens a tree step may carry (it runs whole, in a pass of its own, with a mask of
#: its own: a prompt-sized tree would cost a peer what no step is let cost it)
MAX_TREE_TOKENS = 256

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: Compressed hidden states: int8 values with one float32 scale per position (the last axis is the
#: hidden dimension): payload = prod(shape) bytes of int8, then prod(shape[:-1]) float32 scales.
QUANTIZED = "int8q"
WIRE_DTYPES = (*DTYPE_SIZES, QUANTIZED)
MESSAGE_TYPES = ("open", "ready", "attach", "step", "result", "close", "error")
RESULT_KINDS = ("hidden", "logits")
_HDR = struct.Struct(">I")


class ErrorCode(enum.StrEnum):
    """The ``code`` of an ``error``: every reason a hop refuses or ends a session, and the
    client-side failures (``busy``, ``no_route``) reported with the same codes. A StrEnum: each
    is its wire string and compares equal to it; a code this peer does not know still decodes
    (as a plain string)."""

    # the frame itself (ActivationProtocolError)
    MALFORMED = "malformed"
    TOO_LARGE = "too_large"
    VERSION = "version"
    UNKNOWN_TYPE = "unknown_type"
    DTYPE = "dtype"
    SHAPE = "shape"
    # a step the session cannot take (StepCursor)
    HIDDEN_SIZE = "hidden_size"
    STEP_ORDER = "step_order"
    POSITION = "position"
    TOO_LONG = "too_long"
    # the session and the chain
    UNKNOWN_SESSION = "unknown_session"
    UNEXPECTED = "unexpected"
    IDLE = "idle"
    NEXT_HOP = "next_hop"
    TIMEOUT = "timeout"
    # what a block server refuses at open
    NO_BLOCK = "no_block"
    WRONG_MODEL = "wrong_model"
    LAYERS = "layers"
    NO_HEAD = "no_head"
    TOO_MANY_SESSIONS = "too_many_sessions"
    RATE_LIMITED = "rate_limited"
    KV_BUDGET = "kv_budget"
    # the client's own verdicts (never sent by a peer)
    BUSY = "busy"
    NO_ROUTE = "no_route"


class ActivationProtocolError(ShardnetError, ValueError):
    """A frame that breaks the protocol; ``code`` names the rule (it goes back in an ``error``)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# -- messages ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerRef:
    """Where a stream is opened to: a peer ID and the addresses to dial it at."""

    peer: str
    addrs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "addrs", tuple(self.addrs))

    def to_wire(self) -> dict:
        return {"peer": self.peer, "addrs": list(self.addrs)}


@dataclass(frozen=True)
class Hop:
    """A hop of a chain after the receiver of an ``open``: the peer and the layers it runs."""

    peer: str
    addrs: tuple[str, ...]
    layers: tuple[int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "addrs", tuple(self.addrs))
        object.__setattr__(self, "layers", tuple(self.layers))

    def to_wire(self) -> dict:
        return {"peer": self.peer, "addrs": list(self.addrs), "layers": list(self.layers)}


class _Message:
    """What every message has: ``type`` (its wire name), ``session`` and the ``raw`` frame it was
    decoded from (without the length prefix; what receipts hash; empty for messages built here)."""

    type: ClassVar[str]
    session: bytes
    payload: ClassVar[bytes] = b""

    @property
    def fields(self) -> dict[str, Any]:
        """The header fields after ``v``, ``t``, ``s``, in wire order (optional ones left out)."""
        return {}


@dataclass(frozen=True)
class Open(_Message):
    type: ClassVar[str] = "open"
    session: bytes
    model: str
    layers: tuple[int, int]
    max_len: int
    chain: tuple[Hop, ...]
    ret: PeerRef
    logits: bool = False
    wire: str | None = None
    #: prefix reuse scope (None: no reuse); see the module docstring
    prefix: str | None = None
    raw: bytes = field(default=b"", compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "chain", tuple(self.chain))

    @property
    def fields(self) -> dict[str, Any]:
        f = {"model": self.model, "layers": list(self.layers), "max_len": self.max_len,
             "chain": [h.to_wire() for h in self.chain], "ret": self.ret.to_wire(), "logits": self.logits}
        if self.wire is not None:
            f["wire"] = self.wire
        if self.prefix is not None:
            f["prefix"] = self.prefix
        return f


@dataclass(frozen=True)
class Ready(_Message):
    """Sent upstream once the rest of the chain is ready; ``tree``: every hop from here on takes
    tree steps."""

    type: ClassVar[str] = "ready"
    session: bytes
    tree: bool = False
    raw: bytes = field(default=b"", compare=False, repr=False)

    @property
    def fields(self) -> dict[str, Any]:
        return {"tree": True} if self.tree else {}


@dataclass(frozen=True)
class Attach(_Message):
    """The last hop's first frame on its return stream to the client."""

    type: ClassVar[str] = "attach"
    session: bytes
    raw: bytes = field(default=b"", compare=False, repr=False)


@dataclass(frozen=True)
class Close(_Message):
    type: ClassVar[str] = "close"
    session: bytes
    raw: bytes = field(default=b"", compare=False, repr=False)


@dataclass(frozen=True)
class Step(_Message):
    """Hidden states for positions ``pos``..; ``logits_for`` (1 is left off the wire) final
    positions get logits at a last hop holding the head; ``epoch`` (0 is left off) is the
    speculation epoch."""

    type: ClassVar[str] = "step"
    session: bytes
    n: int
    pos: int
    dtype: str
    shape: tuple[int, ...]
    payload: bytes = b""
    logits_for: int = 1
    epoch: int = 0
    #: parents of a tree step's tokens (None: a sequence); see the module docstring
    tree: tuple[int, ...] | None = None
    #: cached positions to keep before the step (None: none moved)
    keep: tuple[int, ...] | None = None
    raw: bytes = field(default=b"", compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        for name in ("tree", "keep"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def tokens(self) -> int:
        return self.shape[1]

    @property
    def after_keep(self) -> int | None:
        """The cache's length once ``keep`` is applied (None: no keep)."""
        return None if self.keep is None else self.keep[0] + len(self.keep)

    @property
    def fields(self) -> dict[str, Any]:
        f = {"n": self.n, "pos": self.pos, "dtype": self.dtype, "shape": list(self.shape)}
        if self.logits_for != 1:
            f["logits_for"] = self.logits_for
        if self.epoch:
            f["e"] = self.epoch
        if self.tree is not None:
            f["tree"] = list(self.tree)
        if self.keep is not None:
            f["keep"] = list(self.keep)
        return f


@dataclass(frozen=True)
class Result(_Message):
    """The last hop's output for step ``n``: hidden states or logits."""

    type: ClassVar[str] = "result"
    session: bytes
    n: int
    pos: int
    dtype: str
    shape: tuple[int, ...]
    payload: bytes = b""
    kind: str = "hidden"
    raw: bytes = field(default=b"", compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def fields(self) -> dict[str, Any]:
        return {"n": self.n, "pos": self.pos, "dtype": self.dtype, "shape": list(self.shape), "kind": self.kind}


@dataclass(frozen=True)
class Error(_Message):
    """A refusal or failure; ``peer`` names the peer that failed, when the hop that saw it knows.
    ``code`` is an ``ErrorCode`` (or, from a newer peer, a code this one does not know);
    ``need_bytes``/``limit_bytes`` and ``retry_after_s`` are the figures of a busy refusal."""

    type: ClassVar[str] = "error"
    session: bytes
    code: str
    msg: str
    n: int | None = None
    peer: str | None = None
    need_bytes: int | None = None
    limit_bytes: int | None = None
    retry_after_s: float | None = None
    raw: bytes = field(default=b"", compare=False, repr=False)

    @property
    def fields(self) -> dict[str, Any]:
        f: dict[str, Any] = {"code": str(self.code), "msg": self.msg}
        if self.n is not None:
            f["n"] = self.n
        if self.peer is not None:
            f["peer"] = self.peer
        for key in ERROR_FIGURES:
            if getattr(self, key) is not None:
                f[key] = getattr(self, key)
        return f


#: the optional figures of an ``error`` (a busy refusal's), with the types they must have
ERROR_FIGURES: dict[str, type | tuple[type, ...]] = {"need_bytes": int, "limit_bytes": int,
                                                     "retry_after_s": (int, float)}

Message = Open | Ready | Attach | Step | Result | Close | Error
TensorMessage = Step | Result


def step_start(length: int, pos: int | None, keep: list[int] | tuple[int, ...] | None) -> int:
    """Where a sender's next step starts, checked: ``pos``, or by default right after what the
    cache holds once ``keep`` is applied (``length``: positions sent so far). ValueError when
    ``keep`` reaches past what was sent or ``pos`` past what the cache would hold."""
    if keep:
        if keep[-1] >= length:
            raise ValueError(f"position {keep[-1]} to keep is past the {length} sent")
        length = keep[0] + len(keep)
    pos = length if pos is None else pos
    if not 0 <= pos <= length:
        raise ValueError(f"position {pos} is outside 0..{length}")
    return pos


def new_session_id() -> bytes:
    return os.urandom(SESSION_ID_BYTES)


def payload_size(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    if dtype == QUANTIZED:
        return math.prod(shape) + 4 * math.prod(shape[:-1])
    return math.prod(shape) * DTYPE_SIZES[dtype]


# -- codec -------------------------------------------------------------------------------------
def encode(msg: Message, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    header = cbor2.dumps({"v": MESSAGE_VERSION, "t": msg.type, "s": msg.session, **msg.fields})
    try:
        return encode_frame(_HDR.pack(len(header)) + header + msg.payload, max_frame)
    except FrameError as e:
        raise ActivationProtocolError(ErrorCode.TOO_LARGE, str(e)) from None


class ActivationDecoder:
    """Feed bytes, get validated messages."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.frames = FrameDecoder(max_frame)

    def feed(self, data: bytes) -> list[Message]:
        try:
            frames = self.frames.feed(data)
        except FrameError as e:
            raise ActivationProtocolError(ErrorCode.TOO_LARGE, str(e)) from None
        return [decode_frame(f) for f in frames]

    @property
    def pending(self) -> int:
        return self.frames.pending


def decode_frame(frame: bytes) -> Message:
    """The validated message in ``frame`` (without its length prefix); ``raw`` is the frame."""
    if len(frame) < _HDR.size:
        raise ActivationProtocolError(ErrorCode.MALFORMED, "frame shorter than its header length")
    (hlen,) = _HDR.unpack_from(frame)
    if hlen > len(frame) - _HDR.size:
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"header length {hlen} exceeds the frame")
    try:
        header = cbor2.loads(frame[_HDR.size:_HDR.size + hlen])
    except Exception as e:
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"header is not CBOR ({e})") from None
    if not isinstance(header, dict):
        raise ActivationProtocolError(ErrorCode.MALFORMED, "header is not a CBOR map")
    payload = frame[_HDR.size + hlen:]
    version = header.pop("v", None)
    if version != MESSAGE_VERSION:
        raise ActivationProtocolError(ErrorCode.VERSION,
                                      f"unsupported message version {version!r} (speak {MESSAGE_VERSION})")
    mtype = header.pop("t", None)
    if mtype not in MESSAGE_TYPES:
        raise ActivationProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {mtype!r}")
    session = header.pop("s", None)
    if not isinstance(session, bytes) or len(session) != SESSION_ID_BYTES:
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"session ID must be {SESSION_ID_BYTES} bytes")
    _VALIDATORS[mtype](mtype, header, payload)
    if mtype not in ("step", "result") and payload:
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"{mtype} carries {len(payload)} unexpected payload bytes")
    return _BUILDERS[mtype](session, header, payload, frame)


def _need(mtype: str, h: dict, key: str, typ: type) -> Any:
    v = h.get(key)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"{mtype}.{key} missing or of the wrong type")
    return v


def _layers(v: Any, where: str) -> tuple[int, int]:
    if (not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or not 0 <= v[0] < v[1]):
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"{where} must be [start, end] with 0 <= start < end")
    return v[0], v[1]


def _peer_ref(v: Any, where: str) -> None:
    if not isinstance(v, dict) or not isinstance(v.get("peer"), str) or not isinstance(v.get("addrs"), list) \
            or not all(isinstance(a, str) for a in v["addrs"]):
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"{where} must be {{peer: str, addrs: [str]}}")


def _v_open(mtype: str, h: dict, payload: bytes) -> None:
    model = _need(mtype, h, "model", str)
    if len(model) != 64 or any(c not in "0123456789abcdef" for c in model):
        raise ActivationProtocolError(ErrorCode.MALFORMED, "open.model must be a 64-digit hex model ID")
    _layers(h.get("layers"), "open.layers")
    max_len = _need(mtype, h, "max_len", int)
    if max_len <= 0:
        raise ActivationProtocolError(ErrorCode.MALFORMED, "open.max_len must be positive")
    chain = _need(mtype, h, "chain", list)
    if len(chain) > 256:
        raise ActivationProtocolError(ErrorCode.MALFORMED, "open.chain is longer than 256 hops")
    for i, hop in enumerate(chain):
        _peer_ref(hop, f"open.chain[{i}]")
        _layers(hop.get("layers"), f"open.chain[{i}].layers")
    _peer_ref(h.get("ret"), "open.ret")
    if not isinstance(h.get("logits", False), bool):
        raise ActivationProtocolError(ErrorCode.MALFORMED, "open.logits must be a boolean")
    if h.get("wire", "float32") not in WIRE_DTYPES:
        raise ActivationProtocolError(ErrorCode.DTYPE, f"unsupported wire dtype {h.get('wire')!r}")
    prefix = h.get("prefix")
    if prefix is not None and (not isinstance(prefix, str) or not 0 < len(prefix) <= MAX_PREFIX_SCOPE):
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"open.prefix must be a scope of 1 to "
                                      f"{MAX_PREFIX_SCOPE} characters")


def _v_tensor(mtype: str, h: dict, payload: bytes) -> None:
    for key in ("n", "pos"):
        if _need(mtype, h, key, int) < 0:
            raise ActivationProtocolError(ErrorCode.MALFORMED, f"{mtype}.{key} must be >= 0")
    dtype = h.get("dtype")
    if dtype not in WIRE_DTYPES:
        raise ActivationProtocolError(ErrorCode.DTYPE, f"unsupported dtype {dtype!r} (use {', '.join(WIRE_DTYPES)})")
    shape = h.get("shape")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= 4
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ActivationProtocolError(ErrorCode.SHAPE, f"shape must be 1 to 4 non-negative integers, got {shape!r}")
    if dtype == QUANTIZED and not shape[-1]:
        raise ActivationProtocolError(ErrorCode.SHAPE, "int8q needs a non-empty last axis")
    expected = payload_size(dtype, shape)
    if expected != len(payload):
        raise ActivationProtocolError(
            "shape", f"shape {shape} of {dtype} needs {expected} bytes, the frame carries {len(payload)}")
    if mtype == "result" and h.get("kind") not in RESULT_KINDS:
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"result.kind must be one of {RESULT_KINDS}")
    lf = h.get("logits_for", 1)
    if not isinstance(lf, int) or isinstance(lf, bool) or lf < 1:
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"{mtype}.logits_for must be a positive integer")
    ep = h.get("e", 0)
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 0:
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"{mtype}.e must be a non-negative integer")
    if mtype == "step":
        _v_tree(h.get("tree"), shape)
        _v_keep(h.get("keep"))


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _v_tree(tree: Any, shape: list[int]) -> None:
    if tree is None:
        return
    tokens = shape[1] if len(shape) >= 2 else -1
    if not _ints(tree) or len(tree) != tokens:
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"step.tree must be {tokens} parent indices, one per token")
    if tokens > MAX_TREE_TOKENS:
        raise ActivationProtocolError(ErrorCode.TOO_LARGE, f"a tree step carries at most {MAX_TREE_TOKENS} tokens, "
                                      f"this one {tokens}")
    bad = next((i for i, p in enumerate(tree) if not -1 <= p < i), None)
    if bad is not None:
        raise ActivationProtocolError(ErrorCode.MALFORMED, f"step.tree: token {bad}'s parent {tree[bad]} is not "
                                      "an earlier token (or -1)")


def _v_keep(keep: Any) -> None:
    if keep is None:
        return
    if not _ints(keep) or not keep or keep[0] < 0 or any(b <= a for a, b in zip(keep, keep[1:])):
        raise ActivationProtocolError(ErrorCode.MALFORMED, "step.keep must be increasing non-negative positions")


def _v_error(mtype: str, h: dict, payload: bytes) -> None:
    _need(mtype, h, "code", str)
    _need(mtype, h, "msg", str)
    if not isinstance(h.get("peer", ""), str):
        raise ActivationProtocolError(ErrorCode.MALFORMED, "error.peer must be a peer ID string")


def _v_none(mtype: str, h: dict, payload: bytes) -> None:
    pass


_VALIDATORS = {"open": _v_open, "ready": _v_none, "attach": _v_none, "step": _v_tensor,
               "result": _v_tensor, "close": _v_none, "error": _v_error}


# Builders run on validated headers only. Header keys the protocol does not define are ignored.
def _b_open(s: bytes, h: dict, payload: bytes, raw: bytes) -> Open:
    ret = h["ret"]
    return Open(s, model=h["model"], layers=tuple(h["layers"]), max_len=h["max_len"],
                chain=tuple(Hop(c["peer"], c["addrs"], c["layers"]) for c in h["chain"]),
                ret=PeerRef(ret["peer"], ret["addrs"]), logits=h.get("logits", False), wire=h.get("wire"),
                prefix=h.get("prefix"), raw=raw)


def _b_step(s: bytes, h: dict, payload: bytes, raw: bytes) -> Step:
    return Step(s, n=h["n"], pos=h["pos"], dtype=h["dtype"], shape=h["shape"], payload=payload,
                logits_for=h.get("logits_for", 1), epoch=h.get("e", 0), tree=h.get("tree"), keep=h.get("keep"),
                raw=raw)


def _b_result(s: bytes, h: dict, payload: bytes, raw: bytes) -> Result:
    return Result(s, n=h["n"], pos=h["pos"], dtype=h["dtype"], shape=h["shape"], payload=payload,
                  kind=h["kind"], raw=raw)


def _b_error(s: bytes, h: dict, payload: bytes, raw: bytes) -> Error:
    n = h.get("n")  # never checked: an error's step number is informative only
    # nor are the figures: one of the wrong type is left out, like a field this peer does not know
    figures = {k: h[k] for k, typ in ERROR_FIGURES.items()
               if isinstance(h.get(k), typ) and not isinstance(h[k], bool) and h[k] >= 0}
    return Error(s, code=h["code"], msg=h["msg"], n=n if isinstance(n, int) and not isinstance(n, bool) else None,
                 peer=h.get("peer"), raw=raw, **figures)


_BUILDERS = {"open": _b_open, "ready": lambda s, h, p, raw: Ready(s, tree=h.get("tree") is True, raw=raw),
             "attach": lambda s, h, p, raw: Attach(s, raw=raw), "step": _b_step, "result": _b_result,
             "close": lambda s, h, p, raw: Close(s, raw=raw), "error": _b_error}


# -- session state (sans-IO) -------------------------------------------------------------------
@dataclass
class StepCursor:
    """Where a block server's session stands: the step numbers and positions it accepts next.

    Steps come in increasing order but may skip numbers (chunks of a fenced-off speculation
    epoch); a step may start below the cached length (the client rolled back rejected drafts),
    never above it; the cache never holds more than ``max_len`` positions."""

    max_len: int
    hidden_size: int
    next_step: int = 0
    #: positions the session's KV cache holds
    length: int = 0
    #: the first position of the last step, when it was a tree (the next may start one past it)
    tree_at: int | None = None

    def check(self, msg: Step) -> tuple[str, str] | None:
        """(code, message) when the validated step ``msg`` may not be taken now."""
        shape = list(msg.shape)
        if len(shape) != 3 or shape[0] != 1 or shape[1] < 1:
            return ErrorCode.SHAPE, f"hidden states must be [1, tokens, {self.hidden_size}], got {shape}"
        if shape[2] != self.hidden_size:
            return ErrorCode.HIDDEN_SIZE, f"hidden size {shape[2]} does not match the model's {self.hidden_size}"
        if msg.n < self.next_step:
            return ErrorCode.STEP_ORDER, f"step {msg.n} arrived after step {self.next_step - 1}"
        length = self.length
        if msg.keep is not None:
            if msg.keep[-1] >= self.length:
                return ErrorCode.POSITION, f"step keeps position {msg.keep[-1]}, past the {self.length} cached"
            length = msg.after_keep
        elif self.tree_at is not None:
            length = min(length, self.tree_at + 1)  # past the tree's root, only a kept path is text
        if msg.pos > length:
            return ErrorCode.POSITION, f"step starts at position {msg.pos}, past the {length} the KV cache holds"
        if msg.pos + shape[1] > self.max_len:
            return ErrorCode.TOO_LONG, f"{msg.pos + shape[1]} tokens exceed the session's max_len {self.max_len}"
        return None

    def skip(self, msg: Step) -> None:
        """A checked step that will not be computed (fenced off): only its number is used up."""
        self.next_step = msg.n + 1

    def advance(self, msg: Step) -> int:
        """Take a checked step; returns how many cached positions to drop before computing it
        (after its ``keep``, if any, is applied)."""
        drop = (self.length if msg.keep is None else msg.after_keep) - msg.pos
        self.next_step = msg.n + 1
        self.length = msg.pos + msg.shape[1]
        self.tree_at = msg.pos if msg.tree is not None else None
        return drop


class PendingSteps:
    """A client's steps in flight: a result is accepted only as the answer to one of them, in
    step order (results may skip steps a peer dropped as fenced off), at the position the step
    started, of the kind and shape the session expects. So a replayed, reordered or reflected
    frame is refused, whoever sends it."""

    def __init__(self) -> None:
        self._steps: dict[int, tuple[int, int, int]] = {}

    def __len__(self) -> int:
        return len(self._steps)

    def sent(self, n: int, pos: int, tokens: int, logits_for: int = 1) -> None:
        self._steps[n] = (pos, tokens, logits_for)

    def answer(self, msg: Result, *, kind: str, hidden_size: int, vocab: int) -> str | None:
        """Why the validated result ``msg`` answers no step in flight; None when it does (that
        step, and any earlier one still waiting, are then done)."""
        n = msg.n
        if n not in self._steps:
            return f"result {n} answers no step in flight (a replayed or reordered frame?)"
        for k in [k for k in self._steps if k < n]:
            del self._steps[k]
        pos, tokens, logits_for = self._steps.pop(n)
        if msg.pos != pos:
            return f"result {n} is for position {msg.pos}; step {n} started at {pos}"
        if msg.kind != kind:
            return f"result {n} carries {msg.kind}, this session expects {kind}"
        rows, width = (min(logits_for, tokens), vocab) if kind == "logits" else (tokens, hidden_size)
        if list(msg.shape) != [1, rows, width]:
            return f"result {n} has shape {list(msg.shape)}, expected {[1, rows, width]}"
        return None
