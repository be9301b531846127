"""The session rules of ``/shardnet/activation/1.0.0`` as two I/O-free machines.

Every rule about which message may come when lives here: the order open -> ready -> step ->
close, step numbers, rollback, ``max_len``, epoch fencing, which results answer which steps,
and what ends a session. A driver (``inference/server/block_endpoint.py``,
``inference/client/session.py``, ``inference/model/local_session.py``) feeds in what it read
and carries out the action it gets back; no trio and no torch here.

``BlockSession`` is one session as a block server sees it. For each message from upstream it
answers ``Compute`` (crop ``drop`` cached positions first, then run the step), ``Skip`` (fenced
off: a step of a newer speculation epoch is already queued behind it), or one that ends the
session: ``ForwardClose``, ``ReplyError``, ``End``. What comes back from the next hop is
answered with ``Relay`` (an error, passed upstream as it is) or ``ReplyError``.

``ClientSession`` is one session as the client sees it: the open handshake (``ready`` or an
error), the steps in flight, and whether a result answers one of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .activation import (
    SESSION_ID_BYTES,
    ActivationProtocolError,
    Attach,
    Close,
    Error,
    ErrorCode,
    Hop,
    Message,
    Open,
    PeerRef,
    PendingSteps,
    Ready,
    Result,
    Step,
    StepCursor,
    step_start,
)


# -- actions and outcomes ------------------------------------------------------------------------
@dataclass(frozen=True)
class Compute:
    """Run ``step`` after cutting the last ``drop`` cached positions (a rollback; 0: none)."""

    step: Step
    drop: int


@dataclass(frozen=True)
class Skip:
    """Do not compute ``step``, and send nothing on for it (its number is used up)."""

    step: Step


@dataclass(frozen=True)
class ForwardClose:
    """Send ``close`` to the next hop; the session is over."""

    message: Close


@dataclass(frozen=True)
class ReplyError:
    """Send ``error`` upstream; the session is over. ``session`` is the one the reply names
    (the offending frame's, which need not be this session's)."""

    session: bytes
    code: str
    message: str
    n: int | None = None
    peer: str | None = None

    def to_message(self) -> Error:
        return Error(self.session, self.code, self.message, self.n, self.peer)


@dataclass(frozen=True)
class Relay:
    """Pass ``message`` (an error from further down the chain) upstream unchanged; over."""

    message: Error


@dataclass(frozen=True)
class End:
    """The session is over; nothing to send."""


BlockAction = Compute | Skip | ForwardClose | ReplyError | Relay | End


@dataclass(frozen=True)
class Failure:
    """Why a session failed, seen from the client: a code, a message, and the peer to blame
    when known."""

    code: str
    message: str
    peer: str | None = None
    #: a busy refusal's figures, when the hop that refused gave them (see ``Error``)
    need_bytes: int | None = None
    limit_bytes: int | None = None
    retry_after_s: float | None = None

    @classmethod
    def reported(cls, error: Error) -> Failure:
        """The failure an ``error`` message reports, with its figures."""
        return cls(error.code, error.msg, error.peer, need_bytes=error.need_bytes, limit_bytes=error.limit_bytes,
                   retry_after_s=error.retry_after_s)


def answer_to_open(reply: Message | None, *, who: str, closed: Failure) -> Failure | None:
    """The reply to an ``open``: None for ``ready``; ``closed`` when the stream ended first; the
    error it reports; any other message is unexpected (``who`` names the hop that answered)."""
    if reply is None:
        return closed
    if isinstance(reply, Error):
        return Failure.reported(reply)
    if not isinstance(reply, Ready):
        return Failure(ErrorCode.UNEXPECTED, f"{who} answered {reply.type}")
    return None


# -- the block server's side ---------------------------------------------------------------------
#: checks about where a step's positions fall: they do not apply to a step that is skipped (the
#: second of two discarded chunks starts past the cache, since the first was never computed)
_NOT_FOR_SKIPPED = frozenset({ErrorCode.POSITION, ErrorCode.TOO_LONG})

class BlockSession:
    """One session a block server has accepted (``open`` passed its checks).

    ``downstream()`` says where to open the next stream and with what; once that hop is ready
    (``answer_to_open``), ``ready()`` gives the ``ready`` to send upstream; then every message
    read from upstream goes to ``receive`` together with the messages the driver has already
    queued behind it, and everything read from downstream to ``from_downstream``."""

    def __init__(self, op: Open, hidden_size: int) -> None:
        self.open = op
        self.session = op.session
        #: the last hop returns results to the client instead of passing steps on
        self.last = not op.chain
        #: the last hop applies norm + LM head and returns logits
        self.returns_logits = self.last and op.logits
        self.cursor = StepCursor(op.max_len, hidden_size)
        self.state = "opening"

    @classmethod
    def local(cls, hidden_size: int, max_len: int) -> BlockSession:
        """A session with no stream around it (one block in this process, last, returning
        hidden states), already ready: only the step rules apply."""
        op = Open(bytes(SESSION_ID_BYTES), model="0" * 64, layers=(0, 1), max_len=max_len, chain=(),
                  ret=PeerRef("local"))
        session = cls(op, hidden_size)
        session.ready()
        return session

    @property
    def ended(self) -> bool:
        return self.state == "ended"

    # -- opening --------------------------------------------------------------------------------
    def downstream(self) -> tuple[Hop | PeerRef, Open | Attach]:
        """The peer the next stream goes to, and its first message: an ``open`` for the rest of
        the chain, or ``attach`` on the return stream to the client when this hop is last."""
        op = self.open
        if self.last:
            return op.ret, Attach(self.session)
        nxt = op.chain[0]
        return nxt, Open(self.session, model=op.model, layers=nxt.layers, max_len=op.max_len, chain=op.chain[1:],
                         ret=op.ret, logits=op.logits, wire=op.wire, prefix=op.prefix)

    def ready(self, tree: bool = False) -> Ready:
        """The rest of the chain is ready: steps may come. ``tree``: this hop takes tree steps
        and so does the rest of the chain (the last hop: this hop does)."""
        self._expect("opening")
        self.state = "stepping"
        return Ready(self.session, tree=tree)

    # -- from upstream --------------------------------------------------------------------------
    def receive(self, msg: Message, queued: Iterable[Message] = ()) -> BlockAction:
        """What to do with ``msg`` from upstream; ``queued``: messages already read behind it."""
        self._expect("stepping")
        if msg.session != self.session:
            return self._end(ReplyError(msg.session, ErrorCode.UNKNOWN_SESSION, "this stream carries another session"))
        if isinstance(msg, Close):
            return self._end(End() if self.last else ForwardClose(Close(self.session)))
        if not isinstance(msg, Step):
            return self._end(ReplyError(self.session, ErrorCode.UNEXPECTED, f"expected step or close, got {msg.type}"))
        problem = self.cursor.check(msg)
        # (a step that keeps a tree's path is never skipped: later steps' positions count on it)
        fenced = msg.keep is None and any(isinstance(m, Step) and m.epoch > msg.epoch for m in queued)
        if problem and not (fenced and problem[0] in _NOT_FOR_SKIPPED):
            return self._end(ReplyError(self.session, problem[0], problem[1], n=msg.n))
        if fenced:
            # Fencing: a newer speculation epoch is already queued behind this chunk, so the
            # client has discarded it. Skip it here and downstream (step numbers may skip).
            self.cursor.skip(msg)
            return Skip(msg)
        return Compute(msg, self.cursor.advance(msg))

    def end_of_input(self) -> End:
        """Upstream closed the stream."""
        return self._end(End())

    def bad_frame(self, e: ActivationProtocolError) -> ReplyError:
        return self._end(ReplyError(self.session, e.code, e.message))

    def idle(self, timeout: float) -> ReplyError:
        """No message from upstream within ``timeout`` seconds."""
        return self._end(ReplyError(self.session, ErrorCode.IDLE, f"no step for {timeout:g} s; session expired"))

    # -- what goes on ---------------------------------------------------------------------------
    def output(self, step: Step, *, dtype: str, shape: list[int], payload: bytes, kind: str) -> Step | Result:
        """The message carrying ``step``'s output on: a result to the client from the last hop,
        else the step for the next hop (same number, position, logits_for and epoch)."""
        if self.last:
            return Result(self.session, n=step.n, pos=step.pos, dtype=dtype, shape=shape, payload=payload, kind=kind)
        return Step(self.session, n=step.n, pos=step.pos, dtype=dtype, shape=shape, payload=payload,
                    logits_for=step.logits_for, epoch=step.epoch, tree=step.tree, keep=step.keep)

    def refuse(self, step: Step, detail: str) -> ReplyError:
        """A step this hop cannot compute (a tree step where its block takes none) ends the session."""
        return self._end(ReplyError(self.session, ErrorCode.UNEXPECTED, detail, n=step.n))

    def send_failed(self, step: Step, detail: str, peer: str) -> ReplyError:
        """Passing ``step`` on failed: name the peer that failed, or the hop before us would
        blame us when we close."""
        return self._end(ReplyError(self.session, ErrorCode.NEXT_HOP, f"sending to the next hop failed: {detail}",
                                    n=step.n, peer=peer))

    # -- from downstream ------------------------------------------------------------------------
    def from_downstream(self, msg: Message | None, peer: str) -> Relay | ReplyError:
        """Once ready, only errors travel upstream (relayed as they are); the stream ending or
        any other message (reflected or forged) is answered with an error naming ``peer``.
        Either way the session is over: the driver stops its step loop (which may be taking a
        step at this moment, so the machine's own state is left to that loop)."""
        if msg is None:
            return ReplyError(self.session, ErrorCode.NEXT_HOP, "next hop closed the stream", peer=peer)
        if isinstance(msg, Error):
            return Relay(msg)
        return ReplyError(self.session, ErrorCode.UNEXPECTED, f"the next hop sent {msg.type} upstream", peer=peer)

    def downstream_broken(self, detail: str, peer: str) -> ReplyError:
        """Reading from the next hop failed (a reset, a bad frame); over, as ``from_downstream``."""
        return ReplyError(self.session, ErrorCode.NEXT_HOP, f"next hop failed: {detail}", peer=peer)

    def _expect(self, state: str) -> None:
        if self.state != state:
            raise RuntimeError(f"session is {self.state}, not {state}")

    def _end(self, action):
        self.state = "ended"
        return action


# -- the client's side ---------------------------------------------------------------------------
class ClientSession:
    """One session as its client sees it. ``first_peer`` and ``last_peer`` are the chain's ends
    (blamed for what their streams do); results are ``kind`` ("hidden" or "logits")."""

    def __init__(self, session: bytes, *, first_peer: str, last_peer: str, kind: str, hidden_size: int,
                 vocab: int) -> None:
        self.session = session
        self.first_peer, self.last_peer = first_peer, last_peer
        self.kind, self.hidden_size, self.vocab = kind, hidden_size, vocab
        #: positions every hop's KV cache holds once the steps sent so far are computed
        self.length = 0
        #: the next step's number
        self.step_no = 0
        #: steps sent and not yet answered: a result must answer one of them, in order, so a
        #: replayed, reordered or reflected frame is refused
        self.pending = PendingSteps()
        #: every hop of the chain takes tree steps (its ready said so)
        self.trees = False
        #: what ended the session, once something did
        self.failure: Failure | None = None
        self.state = "opening"

    def opened(self, reply: Message | None) -> Failure | None:
        """The first hop's reply to ``open``: None when the chain is ready."""
        self._expect("opening")
        failure = answer_to_open(reply, who="first hop", closed=Failure(
            ErrorCode.NEXT_HOP, f"{self.first_peer[:16]}… closed the stream", self.first_peer))
        if failure is not None:
            return self._fail(failure)
        self.state = "ready"
        self.trees = reply.tree
        return None

    def step(self, *, dtype: str, shape: list[int], payload: bytes, pos: int | None = None, logits_for: int = 1,
             epoch: int = 0, tree: list[int] | None = None, keep: list[int] | None = None) -> Step:
        """The next step (not yet counted as sent: call ``sent`` once it is). ``pos`` defaults to
        right after the last step; lower rolls every hop's cache back first. ``tree`` and
        ``keep``: a tree step and a kept path (the module docstring of activation.py); only to
        a chain whose ready said it takes trees."""
        self._expect("ready")
        if (tree is not None or keep is not None) and not self.trees:
            raise ValueError("this chain does not take tree steps (a hop's ready did not say tree)")
        pos = step_start(self.length, pos, keep)
        return Step(self.session, n=self.step_no, pos=pos, dtype=dtype, shape=shape, payload=payload,
                    logits_for=logits_for, epoch=epoch, tree=tree, keep=keep or None)

    def sent(self, step: Step) -> None:
        self.step_no = step.n + 1
        self.length = step.pos + step.tokens
        self.pending.sent(step.n, step.pos, step.tokens, step.logits_for)

    def result(self, msg: Message | None) -> Result | Failure:
        """The next message of the return stream (None: it ended): the result, or why not. A
        refused result does not end the session by itself (the caller gives it up)."""
        if msg is None:
            return Failure(ErrorCode.NEXT_HOP, "the return stream closed")
        if isinstance(msg, Error):
            return Failure.reported(msg)
        if not isinstance(msg, Result):
            return Failure(ErrorCode.UNEXPECTED, f"expected a result, got {msg.type}", self.last_peer)
        problem = self.pending.answer(msg, kind=self.kind, hidden_size=self.hidden_size, vocab=self.vocab)
        if problem:
            return Failure(ErrorCode.UNEXPECTED, problem, self.last_peer)
        return msg

    def upstream(self, msg: Message | None) -> Failure:
        """A message on the first hop's stream once ready (None: it ended): only errors travel
        upstream, and anything there ends the session."""
        if msg is None:
            return self._fail(Failure(ErrorCode.NEXT_HOP, "the first hop closed the stream", self.first_peer))
        if isinstance(msg, Error):
            return self._fail(Failure.reported(msg))
        return self._fail(Failure(ErrorCode.UNEXPECTED, f"the first hop sent {msg.type} upstream", self.first_peer))

    def upstream_broken(self, detail: str) -> Failure:
        return self._fail(Failure(ErrorCode.NEXT_HOP, detail, self.first_peer))

    def _expect(self, state: str) -> None:
        if self.state != state:
            raise RuntimeError(f"session is {self.state}, not {state}")

    def _fail(self, failure: Failure) -> Failure:
        self.state = "ended"
        if self.failure is None:
            self.failure = failure
        return failure
