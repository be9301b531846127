"""One open chain session seen from the client (``InferenceSession``), and the line requests
wait in for a session slot at a first hop (``SessionSlots``)."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import torch
import trio

from shardnet.errors import InferenceError
from shardnet.inference.model import wire
from shardnet.inference.router import ActivationRouter
from shardnet.protocols import activation as ap
from shardnet.protocols.activation import new_session_id
from shardnet.protocols.activation_io import (
    FOREVER,
    OPEN_TIMEOUT,
    STEP_TIMEOUT,
    MessageStream,
)
from shardnet.protocols.block_claim import Claim
from shardnet.protocols.receipts import HashChain
from shardnet.transport.config import peer_info
from shardnet.transport.errors import ShardnetError
from shardnet.transport.node import Node

if TYPE_CHECKING:
    from shardnet.inference.client.client import Client

log = logging.getLogger(__name__)

#: refusals that mean "not now": the request waits and tries again (see ``Client.session``)
BUSY = frozenset({"too_many_sessions", "rate_limited", "kv_budget"})


class InferenceSession:
    """One open chain: feed hidden states (or token ids) in order, get outputs back."""

    def __init__(self, client: Client, route: list[Claim], max_len: int) -> None:
        self.client, self.route, self.max_len = client, route, max_len
        self.session = new_session_id()
        self.up: MessageStream | None = None
        self.ret: MessageStream | None = None
        self.length = 0
        self.step_no = 0
        self.error: InferenceError | None = None
        #: steps sent and not yet answered: a result must answer one of them, in order, so a
        #: replayed, reordered or reflected frame is refused
        self._awaiting = ap.PendingSteps()
        self._receiving: trio.CancelScope | None = None

    async def _open(self) -> None:
        node, route, s = self.client.node, self.route, self.session
        ep = ActivationRouter.of(node)
        returns = ep.expect_return(s, route[-1].peer)
        first = route[0]
        try:
            try:
                await node.connect(peer_info(first.peer, first.addrs))
                self.up = MessageStream(await node.new_stream(first.peer, ap.PROTOCOL_ID))
                self.up.sent_hash = HashChain()  # the client's side of the first hop's receipt
            except ShardnetError as e:
                raise InferenceError("next_hop", f"cannot reach {first.peer[:16]}…: {e}", first.peer) from None
            me = {"peer": str(node.peer_id), "addrs": [str(a) for a in node.listen_addrs]}
            await self.up.send(ap.open_msg(
                s, model=self.client.model.model_id, layers=(first.start, first.end), max_len=self.max_len,
                chain=[ap.Hop(c.peer, list(c.addrs), (c.start, c.end)) for c in route[1:]],
                ret=me, logits=self.client.logits_on_last, wire=self.client.wire))
            reply = await self.up.recv(OPEN_TIMEOUT * len(route))
            if reply is None:
                raise InferenceError("next_hop", f"{first.peer[:16]}… closed the stream", first.peer)
            if reply.type == "error":
                raise InferenceError(reply["code"], reply["msg"], reply.get("peer"))
            if reply.type != "ready":
                raise InferenceError("unexpected", f"first hop answered {reply.type}")
            with trio.fail_after(OPEN_TIMEOUT):
                self.ret = await returns.receive()
        except trio.TooSlowError:
            raise InferenceError("timeout", "the chain did not become ready in time") from None
        except InferenceError:
            raise
        except ShardnetError as e:  # the first hop went away while opening (a reset, its connection lost)
            raise InferenceError("next_hop", f"{first.peer[:16]}… failed: {e}", first.peer) from None
        finally:
            ep.forget_return(s)

    async def _watch_errors(self) -> None:
        """Errors come back on the first hop's stream; stop waiting for results when one does.
        Lives as long as the session (cancelled when it closes)."""
        try:
            msg = await self.up.recv(FOREVER)
            if msg is None:
                self.error = InferenceError("next_hop", "the first hop closed the stream", self.route[0].peer)
            elif msg.type == "error":
                self.error = InferenceError(msg["code"], msg["msg"], msg.get("peer"))
            else:  # only errors travel upstream once a chain is ready
                self.error = InferenceError("unexpected", f"the first hop sent {msg.type} upstream",
                                            self.route[0].peer)
        except (ShardnetError, ap.ActivationProtocolError) as e:
            self.error = InferenceError("next_hop", str(e), self.route[0].peer)
        if self.error is not None:
            log.warning("chain reported %s", self.error)
            if self._receiving is not None:
                self._receiving.cancel()
            await self.ret.close()

    async def forward(self, hidden: torch.Tensor, *, pos: int | None = None, logits_for: int = 1) -> torch.Tensor:
        """Send [1, tokens, hidden] for positions ``pos``.. (default: right after the last step;
        lower rolls every peer's KV cache back to ``pos`` first). Returns the last block's output:
        [1, tokens, hidden], or [1, logits_for, vocab] logits when the last peer holds the head."""
        n = await self.send(hidden, pos=pos, logits_for=logits_for)
        got, out = await self.receive()
        if got != n:
            raise InferenceError("unexpected", f"expected result {n}, got {got}")
        return out

    async def send(self, hidden: torch.Tensor, *, pos: int | None = None, logits_for: int = 1,
                   epoch: int = 0) -> int:
        """Send one step without waiting for its result (several may be in flight); returns its
        step number. Results come back in order through ``receive``."""
        if self.error:
            raise self.error
        pos = self.length if pos is None else pos
        if not 0 <= pos <= self.length:
            raise ValueError(f"position {pos} is outside 0..{self.length}")
        dtype, shape, payload = wire.to_payload(hidden, self.client.wire)
        n = self.step_no
        try:
            await self.up.send(ap.tensor_msg("step", self.session, n=n, pos=pos, dtype=dtype, shape=shape,
                                             payload=payload, logits_for=logits_for if logits_for != 1 else None,
                                             epoch=epoch))
        except ShardnetError as e:
            raise self.error or InferenceError("next_hop", f"sending to the first hop failed: {e}",
                                               self.route[0].peer) from None
        self.step_no += 1
        self.length = pos + hidden.shape[1]
        self._awaiting.sent(n, pos, hidden.shape[1], logits_for)
        return n

    async def receive(self) -> tuple[int, torch.Tensor]:
        """The next result: (its step number, the tensor)."""
        msg = None
        try:
            # an error reported upstream ends the wait, whatever the return stream does
            with trio.CancelScope() as self._receiving:
                if self.error is None:
                    msg = await self.ret.recv(STEP_TIMEOUT)
        except trio.TooSlowError:
            raise self.error or InferenceError("timeout", f"no result within {STEP_TIMEOUT:g} s") from None
        except ShardnetError:
            pass
        finally:
            self._receiving = None
        if msg is None:
            raise self.error or InferenceError("next_hop", "the return stream closed")
        if msg.type == "error":
            raise InferenceError(msg["code"], msg["msg"], msg.get("peer"))
        if msg.type != "result":
            raise InferenceError("unexpected", f"expected a result, got {msg.type}", self.route[-1].peer)
        problem = self._answers(msg)
        if problem:
            raise InferenceError("unexpected", problem, self.route[-1].peer)
        return msg["n"], wire.from_message(msg)

    def _answers(self, msg: ap.Message) -> str | None:
        config = self.client.model.ckpt.config
        return self._awaiting.answer(msg, kind="logits" if self.client.logits_on_last else "hidden",
                                     hidden_size=config.hidden_size, vocab=config.vocab_size)

    async def close(self) -> None:
        if self.up is not None:
            with trio.move_on_after(5), _quiet():
                await self.up.send(ap.Message("close", self.session))
                await self.up.close()
        if self.ret is not None:
            if self.client.receipts and self.error is None:
                # results still in flight (speculation past the end) are part of the last hop's
                # receipt: read the return stream to its end so both sides hashed the same frames
                with trio.move_on_after(5), _quiet():
                    while await self.ret.recv(FOREVER) is not None:
                        pass
            getattr(self.ret, "done", trio.Event()).set()


def _busy(e: InferenceError) -> bool:
    """Whether a refusal goes away by waiting (a KV budget too small for the session never does)."""
    if e.code not in BUSY:
        return False
    m = re.search(r"needs (\d+) bytes of KV cache; \d+ of (\d+) are free", str(e))
    return e.code != "kv_budget" or m is None or int(m[1]) <= int(m[2])


class SessionSlots:
    """Sessions this node holds open per first hop, at most ``sessions_out_per_peer`` each
    (``SessionSlots.of(node)``, shared by every client of the node). More wait in line, first
    come first served (a trio.Semaphore wakes its waiters in order)."""

    def __init__(self, per_peer: int) -> None:
        self.per_peer = per_peer
        self._sems: dict[str, trio.Semaphore] = {}

    @classmethod
    def of(cls, node: Node) -> SessionSlots:
        slots = getattr(node, "_shardnet_session_slots", None)
        if slots is None:
            slots = node._shardnet_session_slots = cls(node.config.limits.sessions_out_per_peer)
        return slots

    @asynccontextmanager
    async def hold(self, peer: str, deadline: float) -> AsyncIterator[None]:
        sem = self._sems.get(peer)
        if sem is None:
            sem = self._sems[peer] = trio.Semaphore(self.per_peer)
        try:
            with trio.move_on_at(deadline) as waited:
                await sem.acquire()
            if waited.cancelled_caught:
                raise InferenceError("busy", f"no session slot at {peer[:16]}… within the queue timeout "
                                     f"({self.per_peer} sessions per peer, sessions_out_per_peer)", peer)
            try:
                yield
            finally:
                sem.release()
        finally:
            if sem.value == self.per_peer and not sem.statistics().tasks_waiting:
                self._sems.pop(peer, None)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, (ShardnetError, ap.ActivationProtocolError))

