"""One open chain session seen from the client (``InferenceSession``), and how a request opens one
(``open_session``: waiting in line while the chain is busy, in the node's ``SessionSlots``)."""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
import trio

from shardnet.errors import HeldError, InferenceError
from shardnet.inference.client.request import RequestContext
from shardnet.inference.model import wire
from shardnet.inference.router import ActivationRouter
from shardnet.protocols import activation as ap
from shardnet.protocols.activation import ErrorCode, new_session_id
from shardnet.protocols.activation_io import (
    FOREVER,
    OPEN_TIMEOUT,
    STEP_TIMEOUT,
    MessageStream,
    open_hop,
)
from shardnet.protocols.activation_session import ClientSession, Failure
from shardnet.protocols.block_claim import Claim
from shardnet.protocols.receipts import HashChain
from shardnet.transport.errors import ShardnetError

log = logging.getLogger(__name__)

#: refusals that mean "not now": the request waits and tries again (see ``open_session``)
BUSY = frozenset({ErrorCode.TOO_MANY_SESSIONS, ErrorCode.RATE_LIMITED, ErrorCode.KV_BUDGET})


class InferenceSession:
    """One open chain: feed hidden states (or token ids) in order, get outputs back."""

    def __init__(self, request: RequestContext, route: list[Claim], max_len: int) -> None:
        self.request, self.route, self.max_len = request, route, max_len
        self.session = new_session_id()
        config = request.model.ckpt.config
        #: the protocol's rules for this session: the open handshake, steps in flight, results
        self.machine = ClientSession(self.session, first_peer=route[0].peer, last_peer=route[-1].peer,
                                     kind="logits" if request.logits_on_last else "hidden",
                                     hidden_size=config.hidden_size, vocab=config.vocab_size)
        self.up: MessageStream | None = None
        self.ret: MessageStream | None = None
        self.error: InferenceError | None = None
        self._receiving: trio.CancelScope | None = None

    @property
    def length(self) -> int:
        """Positions every hop's KV cache holds once the steps sent so far are computed."""
        return self.machine.length

    @property
    def step_no(self) -> int:
        return self.machine.step_no

    async def _open(self) -> None:
        node, route, s = self.request.node, self.route, self.session
        ep = ActivationRouter.of(node)
        returns = ep.expect_return(s, route[-1].peer)
        first = route[0]
        me = ap.PeerRef(str(node.peer_id), [str(a) for a in node.listen_addrs])
        op = ap.Open(s, model=self.request.model.model_id, layers=(first.start, first.end), max_len=self.max_len,
                     chain=[ap.Hop(c.peer, c.addrs, (c.start, c.end)) for c in route[1:]],
                     ret=me, logits=self.request.logits_on_last, wire=self.request.wire, prefix=self.request.prefix)
        try:
            # the client's side of the first hop's receipt hashes what it sends
            self.up, reply = await open_hop(node, first.peer, first.addrs, op, reply_timeout=OPEN_TIMEOUT * len(route),
                                            sent_hash=HashChain())
            failure = self.machine.opened(reply)
            if failure is not None:
                raise _error(failure)
            with trio.fail_after(OPEN_TIMEOUT):
                self.ret = await returns.receive()
        except trio.TooSlowError:
            raise InferenceError(ErrorCode.TIMEOUT, "the chain did not become ready in time") from None
        finally:
            ep.forget_return(s)

    async def _watch_errors(self) -> None:
        """Errors come back on the first hop's stream; stop waiting for results when one does.
        Lives as long as the session (cancelled when it closes)."""
        try:
            failure = self.machine.upstream(await self.up.recv(FOREVER))
        except ShardnetError as e:  # ActivationProtocolError included
            failure = self.machine.upstream_broken(str(e))
        self.error = _error(failure)
        log.warning("chain reported %s", self.error)
        if self._receiving is not None:
            self._receiving.cancel()
        await self.ret.close()

    async def forward(self, hidden: torch.Tensor, *, pos: int | None = None, logits_for: int = 1,
                      tree: list[int] | None = None) -> torch.Tensor:
        """Send [1, tokens, hidden] for positions ``pos``.. (default: right after the last step;
        lower rolls every peer's KV cache back to ``pos`` first). Returns the last block's output:
        [1, tokens, hidden], or [1, logits_for, vocab] logits when the last peer holds the head."""
        n = await self.send(hidden, pos=pos, logits_for=logits_for, tree=tree)
        got, out = await self.receive()
        if got != n:
            raise InferenceError(ErrorCode.UNEXPECTED, f"expected result {n}, got {got}")
        return out

    @property
    def trees(self) -> bool:
        """Whether every hop of the chain takes tree steps (``send``'s ``tree`` and ``keep``)."""
        return self.machine.trees

    async def send(self, hidden: torch.Tensor, *, pos: int | None = None, logits_for: int = 1,
                   epoch: int = 0, tree: list[int] | None = None, keep: list[int] | None = None) -> int:
        """Send one step without waiting for its result (several may be in flight); returns its
        step number. Results come back in order through ``receive``. ``tree``: the step's
        tokens are a tree of drafts (parent indices, -1: the text); ``keep``: cached positions
        kept before the step (a tree step's accepted path); see protocols/activation.py."""
        if self.error:
            raise self.error
        dtype, shape, payload = wire.to_payload(hidden, self.request.wire)
        step = self.machine.step(dtype=dtype, shape=shape, payload=payload, pos=pos, logits_for=logits_for,
                                 epoch=epoch, tree=tree, keep=keep)
        try:
            await self.up.send(step)
        except ap.ActivationProtocolError:
            raise  # the step cannot be encoded (too large): not the first hop's fault
        except ShardnetError as e:
            raise self.error or InferenceError(ErrorCode.NEXT_HOP, f"sending to the first hop failed: {e}",
                                               self.route[0].peer) from None
        self.machine.sent(step)
        return step.n

    async def receive(self) -> tuple[int, torch.Tensor]:
        """The next result: (its step number, the tensor)."""
        msg = None
        try:
            # an error reported upstream ends the wait, whatever the return stream does
            with trio.CancelScope() as self._receiving:
                if self.error is None:
                    msg = await self.ret.recv(STEP_TIMEOUT)
        except trio.TooSlowError:
            raise self.error or InferenceError(ErrorCode.TIMEOUT, f"no result within {STEP_TIMEOUT:g} s") from None
        except ap.ActivationProtocolError:
            raise  # a bad frame on the return stream, as it is
        except ShardnetError:
            pass
        finally:
            self._receiving = None
        answer = self.machine.result(msg)
        if isinstance(answer, Failure):
            raise (self.error if msg is None and self.error else _error(answer))
        return answer.n, wire.from_message(answer)

    async def close(self) -> None:
        if self.up is not None:
            with trio.move_on_after(5), _quiet():
                await self.up.send(ap.Close(self.session))
                await self.up.close()
        if self.ret is not None:
            if self.request.receipts and self.error is None:
                # results still in flight (speculation past the end) are part of the last hop's
                # receipt: read the return stream to its end so both sides hashed the same frames
                with trio.move_on_after(5), _quiet():
                    while await self.ret.recv(FOREVER) is not None:
                        pass
            getattr(self.ret, "done", trio.Event()).set()


@asynccontextmanager
async def open_session(request: RequestContext, max_len: int,
                       route: list[Claim] | None = None) -> AsyncIterator[InferenceSession]:
    """An open chain session (through ``route``, else one the planner finds). Over
    ``sessions_out_per_peer`` sessions at the first hop, or refused as busy by a hop (its
    ``sessions_per_peer``, session rate or KV budget), the request waits in line and tries again,
    up to ``queue_timeout``; then InferenceError "busy". Queueing is what a user of an overloaded
    server expects (requests take longer, none fail); failing at once would hand every caller a
    retry loop of its own, and retrying without a line would let the last comer overtake those
    waiting. Slots are kept here, where the requests are (the client knows its own sessions; a
    peer only sees that one upstream peer holds too many), and a hop's refusal further down the
    chain, which no client-side count can foresee, is waited out with a jittered backoff."""
    route = route or await request.planner.find_route()
    deadline = trio.current_time() + request.queue_timeout
    async with request.session_slots.hold(route[0].peer, deadline):
        sess = await _open_when_free(request, route, max_len, deadline)
        held = HeldError()  # re-raised below as itself, not as an exception group
        try:
            # routing counts this session's KV on its hops until it closes (own_load.py)
            with request.planner.own_load.holding(route, max_len):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sess._watch_errors)
                    try:
                        with held:
                            yield sess
                    finally:
                        nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await sess.close()
    held.reraise()


async def _open_when_free(request: RequestContext, route: list[Claim], max_len: int,
                          deadline: float) -> InferenceSession:
    delay = 0.1
    while True:
        sess = InferenceSession(request, route, max_len)
        try:
            await sess._open()
            return sess
        except InferenceError as e:
            with trio.CancelScope(shield=True):
                await sess.close()
            if not _busy(e):
                raise
            if trio.current_time() + delay >= deadline:
                raise InferenceError(ErrorCode.BUSY, f"the chain stayed busy for {request.queue_timeout:g} s: {e}",
                                     e.peer) from None
            log.info("chain busy (%s); trying again in %.1f s", e, delay)
        except BaseException:
            with trio.CancelScope(shield=True):
                await sess.close()
            raise
        await trio.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(2.0, delay * 2)


def _error(failure: Failure) -> InferenceError:
    return InferenceError(failure.code, failure.message, failure.peer, need_bytes=failure.need_bytes,
                          limit_bytes=failure.limit_bytes, retry_after_s=failure.retry_after_s)


def _busy(e: InferenceError) -> bool:
    """Whether a refusal goes away by waiting: a KV budget too small for the session never does.
    A refusal without its figures (from an older peer) is taken as one that does."""
    if e.code not in BUSY:
        return False
    if e.code != ErrorCode.KV_BUDGET or e.need_bytes is None or e.limit_bytes is None:
        return True
    return e.need_bytes <= e.limit_bytes


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, ShardnetError)  # ActivationProtocolError included

