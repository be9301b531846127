"""The client ("head"): tokenizer, embeddings, final norm and LM head; generation through a chain.

    model = LocalModel("path/to/checkpoint")
    client = Client(node, model)
    async for tok in client.generate("def main(", max_new_tokens=32):
        print(tok.text, end="")

Compute peers see hidden states, never token ids; with ``logits_on_last=True`` the last peer
applies the final norm and LM head and returns logits (for clients too thin to hold the head).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio

from shardnet.protocols import activation as ap
from shardnet.protocols.block_claim import Claim
from shardnet.transport.config import peer_info
from shardnet.transport.errors import ShardnetError
from shardnet.transport.node import Node

from . import wire
from .block import Head, pick_device, resolve_dtype
from .checkpoint import Checkpoint
from .claims import NoRouteError, find_claims, plan_route
from .endpoint import FOREVER, OPEN_TIMEOUT, STEP_TIMEOUT, ActivationEndpoint, InferenceError, MessageStream, new_session_id
from .sampling import SamplingParams, next_token, probabilities
from .speculative import Drafter, SpeculationStats, accept_greedy, accept_sampled

log = logging.getLogger(__name__)


class LocalModel:
    """What a client holds of a model: tokenizer, embeddings, final norm, LM head, identity."""

    def __init__(self, path: str | Path, *, dtype: str = "float32", device: str | None = None,
                 lm_head: bool = True) -> None:
        from tokenizers import Tokenizer

        self.ckpt = Checkpoint(path)
        self.model_id = self.ckpt.model_id
        self.dtype = resolve_dtype(dtype)
        self.device = pick_device(device)
        self.head = Head(self.ckpt, dtype=self.dtype, device=self.device, lm_head=lm_head)
        tok_file = self.ckpt.path / "tokenizer.json"
        if not tok_file.is_file():
            raise ShardnetError(f"{self.ckpt.path} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        self.eos_ids = self._eos_ids()

    def _eos_ids(self) -> set[int]:
        ids = set()
        eos = self.ckpt.raw_config.get("eos_token_id")
        for v in eos if isinstance(eos, list) else [eos]:
            if isinstance(v, int):
                ids.add(v)
        tc = self.ckpt.path / "tokenizer_config.json"
        if tc.is_file():
            tok = json.loads(tc.read_text()).get("eos_token")
            if isinstance(tok, str) and self.tokenizer.token_to_id(tok) is not None:
                ids.add(self.tokenizer.token_to_id(tok))
        return ids

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


@dataclass
class Token:
    id: int
    text: str


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    chain: list[Claim] = field(default_factory=list)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0


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

    async def _open(self) -> None:
        node, route, s = self.client.node, self.route, self.session
        ep = ActivationEndpoint.of(node)
        returns = ep.expect_return(s, route[-1].peer)
        first = route[0]
        try:
            await node.connect(peer_info(first.peer, first.addrs))
            self.up = MessageStream(await node.new_stream(first.peer, ap.PROTOCOL_ID))
            me = {"peer": str(node.peer_id), "addrs": [str(a) for a in node.listen_addrs]}
            await self.up.send(ap.open_msg(
                s, model=self.client.model.model_id, layers=(first.start, first.end), max_len=self.max_len,
                chain=[ap.Hop(c.peer, list(c.addrs), (c.start, c.end)) for c in route[1:]],
                ret=me, logits=self.client.logits_on_last, wire=self.client.wire))
            reply = await self.up.recv(OPEN_TIMEOUT * len(route))
            if reply is None:
                raise InferenceError("next_hop", f"{first.peer[:16]}… closed the stream")
            if reply.type == "error":
                raise InferenceError(reply["code"], reply["msg"])
            if reply.type != "ready":
                raise InferenceError("unexpected", f"first hop answered {reply.type}")
            with trio.fail_after(OPEN_TIMEOUT):
                self.ret = await returns.receive()
        except trio.TooSlowError:
            raise InferenceError("timeout", "the chain did not become ready in time") from None
        finally:
            ep.forget_return(s)

    async def _watch_errors(self) -> None:
        """Errors come back on the first hop's stream; stop waiting for results when one does.
        Lives as long as the session (cancelled when it closes)."""
        try:
            msg = await self.up.recv(FOREVER)
            if msg is not None and msg.type == "error":
                self.error = InferenceError(msg["code"], msg["msg"])
        except (ShardnetError, ap.ActivationProtocolError) as e:
            self.error = InferenceError("next_hop", str(e))
        if self.error is not None:
            log.warning("chain reported %s", self.error)
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
        await self.up.send(ap.tensor_msg("step", self.session, n=n, pos=pos, dtype=dtype, shape=shape,
                                         payload=payload, logits_for=logits_for if logits_for != 1 else None,
                                         epoch=epoch))
        self.step_no += 1
        self.length = pos + hidden.shape[1]
        return n

    async def receive(self) -> tuple[int, torch.Tensor]:
        """The next result: (its step number, the tensor)."""
        try:
            msg = await self.ret.recv(STEP_TIMEOUT)
        except trio.TooSlowError:
            raise self.error or InferenceError("timeout", f"no result within {STEP_TIMEOUT:g} s") from None
        except ShardnetError:
            msg = None
        if msg is None:
            raise self.error or InferenceError("next_hop", "the return stream closed")
        if msg.type == "error":
            raise InferenceError(msg["code"], msg["msg"])
        if msg.type != "result":
            raise InferenceError("unexpected", f"expected a result, got {msg.type}")
        return msg["n"], wire.from_message(msg)

    async def close(self) -> None:
        if self.up is not None:
            with trio.move_on_after(5), _quiet():
                await self.up.send(ap.Message("close", self.session))
                await self.up.close()
        if self.ret is not None:
            getattr(self.ret, "done", trio.Event()).set()


class Client:
    def __init__(self, node: Node, model: LocalModel, *, logits_on_last: bool = False,
                 route: list[Claim] | None = None, route_timeout: float = 30.0, wire: str | None = None) -> None:
        self.node, self.model = node, model
        if wire is not None and wire not in ap.WIRE_DTYPES:
            raise ShardnetError(f"unknown wire dtype {wire!r} (choose from {', '.join(ap.WIRE_DTYPES)})")
        #: how hidden states travel between hops (None: the model's dtype, uncompressed)
        self.wire = wire
        self.route_timeout = route_timeout
        self.logits_on_last = logits_on_last
        self.fixed_route = route
        self.last_stats: GenerationStats | None = None
        ActivationEndpoint.of(node)  # accept the chain's direct return

    async def find_route(self, *, timeout: float | None = None) -> list[Claim]:
        """A chain covering every layer; waits up to ``timeout`` for peers to appear."""
        if self.fixed_route:
            return self.fixed_route
        timeout = self.route_timeout if timeout is None else timeout
        deadline = trio.current_time() + timeout
        last_error: Exception | None = None
        while trio.current_time() < deadline:
            claims = await find_claims(self.node, self.model.model_id,
                                       timeout=max(1.0, min(15.0, deadline - trio.current_time())))
            try:
                return plan_route(claims, self.model.ckpt.num_layers)
            except NoRouteError as e:
                last_error = e
            await trio.sleep(1.0)
        raise NoRouteError(f"after {timeout:g} s: {last_error}")

    @asynccontextmanager
    async def session(self, max_len: int, route: list[Claim] | None = None) -> AsyncIterator[InferenceSession]:
        route = route or await self.find_route()
        sess = InferenceSession(self, route, max_len)
        body_error: BaseException | None = None
        try:
            await sess._open()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sess._watch_errors)
                try:
                    yield sess
                except BaseException as e:  # re-raised below as itself, not as an exception group
                    body_error = e
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await sess.close()
        if body_error is not None:
            raise body_error

    async def generate(self, prompt: str | list[int], max_new_tokens: int = 32, *, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop_at_eos: bool = True,
                       drafter: Drafter | None = None, k: int = 4, depth: int = 1) -> AsyncIterator[Token]:
        """Yield generated tokens one at a time (text in, text out).

        With a ``drafter`` each chain traversal verifies up to ``k`` drafted tokens: greedy output is
        identical to plain greedy decoding, and sampled output has exactly the distribution of
        plain sampling (lossless speculative sampling). With greedy decoding, ``depth`` > 1 keeps
        that many verify chunks in flight, drafting ahead on the assumption that earlier chunks
        are fully accepted; a rejection starts a new epoch and the stale chunks are discarded
        (and dropped by the peers). Output stays identical to plain greedy decoding.
        """
        params = SamplingParams(temperature, top_p, top_k, seed)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        ids = self.model.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ShardnetError("empty prompt")
        stats = GenerationStats(prompt_tokens=len(ids))
        route = await self.find_route()
        stats.chain = route
        self.last_stats = stats
        out_ids: list[int] = []
        extra = (k + 1) * max(depth, 1) if drafter is not None else 0  # drafts may run past the end
        async with self.session(len(ids) + max_new_tokens + extra, route) as sess:
            t0 = time.perf_counter()
            logits = await self._logits(sess, torch.tensor([ids]), pos=0)
            stats.prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            pending = [next_token(logits[-1], params, gen)]
            if drafter is not None and params.greedy and depth > 1:
                async for tok in self._pipelined(sess, ids, pending[0], drafter, k, depth, max_new_tokens,
                                                 stop_at_eos, stats, t0):
                    yield tok
                return
            while pending:
                for tok in pending:
                    emitted = self._emit(out_ids, tok, stats, t0, max_new_tokens, stop_at_eos)
                    if emitted is None:
                        return
                    yield emitted
                if len(out_ids) >= max_new_tokens:
                    return
                seq = ids + out_ids
                if drafter is None:
                    logits = await self._logits(sess, torch.tensor([[seq[-1]]]), pos=len(seq) - 1)
                    pending = [next_token(logits[-1], params, gen)]
                    continue
                budget = min(k, max_new_tokens - len(out_ids))
                vocab = self.model.ckpt.config.vocab_size
                if params.greedy:
                    drafts = drafter.propose(seq, budget)
                else:
                    drafts, q = drafter.sample(seq, budget, params, gen, vocab)
                feed = [seq[-1]] + drafts
                logits = await self._logits(sess, torch.tensor([feed]), pos=len(seq) - 1, every_position=True)
                if params.greedy:
                    pending = accept_greedy(drafts, logits.argmax(-1).tolist())
                else:
                    p = torch.stack([probabilities(row, params) for row in logits])
                    pending = accept_sampled(drafts, q, p, gen)
                spec = stats.speculation
                spec.traversals += 1
                spec.drafted += len(drafts)
                spec.accepted += len(pending) - 1

    def _emit(self, out: list[int], tok: int, stats: GenerationStats, t0: float, max_new: int,
              stop_at_eos: bool) -> Token | None:
        """Append an accepted token and return it with its text, or None when generation ends."""
        if stop_at_eos and tok in self.model.eos_ids or len(out) >= max_new:
            return None
        out.append(tok)
        stats.new_tokens += 1
        stats.decode_s = time.perf_counter() - t0
        # decode incrementally so multi-token characters come out whole
        text = self.model.decode(out)
        prev = self.model.decode(out[:-1]) if len(out) > 1 else ""
        return Token(tok, text[len(prev):])

    async def _pipelined(self, sess: InferenceSession, prompt: list[int], first: int, drafter: Drafter, k: int,
                         depth: int, max_new: int, stop_at_eos: bool, stats: GenerationStats,
                         t0: float) -> AsyncIterator[Token]:
        """Greedy speculative decoding with up to ``depth`` verify chunks in flight."""
        out: list[int] = []
        spec = list(prompt)  # accepted text plus every draft in flight
        inflight: list[tuple[int, int, list[int]]] = []  # (step number, epoch, drafts)
        epoch = 0
        todo = [first]
        while True:
            for tok in todo:  # emit accepted tokens
                emitted = self._emit(out, tok, stats, t0, max_new, stop_at_eos)
                if emitted is None:
                    return
                yield emitted
            if len(out) >= max_new:
                return
            if todo:  # the accepted text changed: drafts continue from it
                spec = prompt + out + [d for _, e, ds in inflight if e == epoch for d in ds]
            todo = []
            # keep `depth` chunks in flight, drafting ahead as if earlier chunks were all accepted
            while len(inflight) < depth and len(spec) - len(prompt) < max_new:
                drafts = drafter.propose(spec, k)
                if not drafts and inflight:
                    break  # nothing to speculate on: wait for a result first
                feed = [spec[-1]] + drafts
                n = await sess.send(self.model.head.embed(torch.tensor([feed])), pos=len(spec) - 1,
                                    logits_for=len(feed), epoch=epoch)
                inflight.append((n, epoch, drafts))
                spec += drafts
                stats.speculation.traversals += 1
                stats.speculation.drafted += len(drafts)
                if not drafts:
                    break
            n, result = await sess.receive()
            while inflight and inflight[0][0] < n:  # chunks the peers dropped as stale
                inflight.pop(0)
            sent_n, sent_epoch, drafts = inflight.pop(0)
            if sent_n != n:
                raise InferenceError("unexpected", f"result {n} does not match step {sent_n}")
            if sent_epoch != epoch:
                continue  # stale: a rejection came back earlier
            if self.logits_on_last:
                targets = result[0].float().argmax(-1).tolist()
            else:
                targets = self.model.head.logits(result)[0].argmax(-1).tolist()
            kept = accept_greedy(drafts, targets)
            stats.speculation.accepted += len(kept) - 1
            later = [x for x in inflight if x[1] == epoch]
            if len(kept) == len(drafts) + 1 and later:
                # all accepted: the next chunk in flight verifies what follows, bonus included
                todo = kept[:-1]
            else:
                todo = kept
                if later:
                    epoch += 1  # everything in flight drafted past a rejection: fence it off

    async def _logits(self, sess: InferenceSession, ids: torch.Tensor, *, pos: int,
                      every_position: bool = False) -> torch.Tensor:
        """Logits [positions, vocab]: for the last position of ``ids``, or for each of them."""
        want = ids.shape[1] if every_position else 1
        out = await sess.forward(self.model.head.embed(ids), pos=pos, logits_for=want)
        if self.logits_on_last:
            return out[0, -want:].float()
        return self.model.head.logits(out[:, -want:, :])[0]


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, ShardnetError)
