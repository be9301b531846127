"""The client ("head"): tokenizer, embeddings, final norm and LM head; generation through a chain.

    model = LocalModel("path/to/checkpoint")
    client = Client(node, model)
    async for tok in client.generate("def main(", max_new_tokens=32):
        print(tok.text, end="")

Compute peers see hidden states, never token ids; with ``logits_on_last=True`` the last peer
applies the final norm and LM head and returns logits (for clients too thin to hold the head).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio

from shardnet import __version__
from shardnet.protocols import activation as ap
from shardnet.protocols import receipts as rc
from shardnet.protocols.block_claim import Claim
from shardnet.protocols.receipts import HashChain
from shardnet.transport.config import peer_info
from shardnet.transport.errors import ShardnetError
from shardnet.transport.node import Node

from . import wire
from .block import Head, pick_device, resolve_dtype
from .checkpoint import Checkpoint
from .claims import CLAIM_TTL, RTT_SAMPLES, NoRouteError, find_claims
from .endpoint import (
    FOREVER,
    OPEN_TIMEOUT,
    STEP_TIMEOUT,
    ActivationEndpoint,
    InferenceError,
    MessageStream,
    new_session_id,
)
from .audit import DEFAULT_AUDIT_RATE, AuditStats, RunAuditor
from .healing import Heal, HealingSession
from .receipt_service import ReceiptService
from .reputation import Reputation
from .routing import plan_route
from .sampling import Randomness, SamplingParams, next_token, probabilities
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
    """A generated token. ``retracted`` > 0: the last ``retracted`` tokens before this one are
    withdrawn (a peer that computed them was caught computing wrong; this one replaces them). When
    the corrected text ends right there, a last Token with ``id`` None carries the retraction."""

    id: int | None
    text: str
    retracted: int = 0

    def apply(self, ids: list[int]) -> None:
        """Bring a list of the ids received so far up to date with this token."""
        if self.retracted:
            del ids[len(ids) - self.retracted:]
        if self.id is not None:
            ids.append(self.id)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    chain: list[Claim] = field(default_factory=list)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    heals: list[Heal] = field(default_factory=list)
    audit: AuditStats | None = None  # honest-compute checks, when on
    retracted: int = 0  # tokens withdrawn because a peer was caught computing wrong

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class _Chunk:
    """A verify chunk in flight."""

    n: int  # step number
    epoch: int  # of the speculation: a rejection ends one
    start: int  # position of the first draft
    drafts: list[int]
    q: torch.Tensor | None  # the distributions sampled drafts were drawn from
    sent: float  # perf_counter() when sent


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
        ep = ActivationEndpoint.of(node)
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


#: route cost of a hop whose round trip we could not measure (seconds)
UNKNOWN_RTT = 0.05
#: a relayed hop's round trip counts this many times (every byte crosses the relay twice)
RELAYED_RTT_FACTOR = 3.0
#: how much cheaper a peer already in the chain looks when a chain heals (keep what works)
KEEP_DISCOUNT = 0.25
RTT_CACHE_S = 30.0


class Client:
    def __init__(self, node: Node, model: LocalModel, *, logits_on_last: bool = False,
                 route: list[Claim] | None = None, route_timeout: float = 30.0, wire: str | None = None,
                 max_heals: int = 5, receipts: bool = True, audit_rate: float = DEFAULT_AUDIT_RATE) -> None:
        self.node, self.model = node, model
        if wire is not None and wire not in ap.WIRE_DTYPES:
            raise ShardnetError(f"unknown wire dtype {wire!r} (choose from {', '.join(ap.WIRE_DTYPES)})")
        #: how hidden states travel between hops (None: the model's dtype, uncompressed)
        self.wire = wire
        self.route_timeout = route_timeout
        self.logits_on_last = logits_on_last
        self.fixed_route = route
        self.max_heals = max_heals
        #: keep what a run receipt needs (hash chains; the last run's facts): see ``run_receipt``
        self.receipts = receipts
        #: share of results re-run on other peers of a span (honest-compute checks; see ``audit``)
        self.audit_rate = audit_rate
        #: what this client saw of each peer's honesty; convicted peers are never routed through
        self.reputation = Reputation()
        me = str(node.peer_id)
        ReceiptService.of(node).listeners.append(
            lambda report: report["reporter"] != me and self.reputation.note_report(report))
        self._last_run: dict | None = None
        self.last_stats: GenerationStats | None = None
        self._avoid: dict[str, float] = {}  # peer -> until (trio time): failed during a request
        self._rtt: dict[str, tuple[float, float]] = {}  # peer -> (seconds, measured at)
        self._claims: list[Claim] = []  # the last claims found, and when (Unix time)
        self._claims_at = 0.0
        ActivationEndpoint.of(node)  # accept the chain's direct return

    def forget_peer(self, peer: str, seconds: float = CLAIM_TTL) -> None:
        """Route around ``peer`` for a while (its claim may outlive it in the DHT)."""
        self._avoid[peer] = trio.current_time() + seconds

    async def find_route(self, *, timeout: float | None = None, avoid: set[str] | frozenset = frozenset(),
                         keep: list[Claim] | None = None) -> list[Claim]:
        """The cheapest chain covering every layer (see ``routing``); waits up to ``timeout`` for
        peers to appear, then raises NoRouteError naming the layers nobody serves. ``keep``:
        claims of a chain being healed, preferred so that only failed spans change."""
        if self.fixed_route:
            if not (avoid & {c.peer for c in self.fixed_route}):
                return self.fixed_route
            raise NoRouteError("a peer of the fixed route failed: "
                               + ", ".join(c.peer[:16] for c in self.fixed_route if c.peer in avoid))
        timeout = self.route_timeout if timeout is None else timeout
        deadline = trio.current_time() + timeout
        kept = {c.peer for c in keep or ()}
        last_error: Exception | None = None
        # Healing is in a hurry: first the claims seen moments ago (their peers' liveness is
        # checked below anyway), then the DHT again.
        cached = self._recent_claims() if keep is not None else None
        while True:
            now = trio.current_time()
            from_cache = cached is not None
            if cached is not None:
                claims, cached = cached, None
            else:
                claims = await self._find_claims(timeout=max(1.0, min(15.0, deadline - now)))
            try:
                usable = self._usable(claims, avoid)
                plan_route(usable, self.model.ckpt.num_layers)  # fail fast, before measuring anything
                await self._measure_rtts([c.peer for c in usable])
                usable = self._usable(claims, avoid)  # without the peers that did not answer

                def cost(prev: Claim | None, c: Claim) -> float:
                    return self.hop_cost(prev, c) * (KEEP_DISCOUNT if c.peer in kept else 1.0)

                route = plan_route(usable, self.model.ckpt.num_layers, cost=cost, finish=self.return_cost)
                log.info("route: %s (estimated %.1f ms per token)",
                         " -> ".join(f"{c.peer[:12]}…[{c.start}:{c.end}]" for c in route),
                         1000 * self.route_cost(route))
                return route
            except NoRouteError as e:
                last_error = e
                if from_cache:
                    continue  # straight to the DHT
            if trio.current_time() + 1.0 >= deadline:
                raise NoRouteError(f"after {timeout:g} s: {last_error}")
            await trio.sleep(1.0)

    async def run_receipt(self, *, wait: float = 10.0) -> dict:
        """The last ``generate``'s run receipt, signed by this node's key: JSON-ready (see
        protocols/receipts.py). Fetches each peer's stage receipt of the final session."""
        from .receipt_service import fetch_session_receipts

        run = self._last_run
        if run is None or not run["session"].entered:
            raise ShardnetError("no generation to write a receipt for")
        if not self.receipts:
            raise ShardnetError("this client was made with receipts=False")
        stats, hs = run["stats"], run["session"]
        final, route = hs.entered[-1]
        sid = final.session.hex()
        blobs: list[bytes | None] = [None] * len(route)

        async def one(i: int, peer: str) -> None:
            blobs[i] = await fetch_session_receipts(self.node, peer, sid, wait=wait)

        async with trio.open_nursery() as nursery:
            for i, c in enumerate(route):
                nursery.start_soon(one, i, c.peer)
        missing = [c.peer[:16] for c, b in zip(route, blobs) if b is None]
        if missing:
            raise ShardnetError(f"no stage receipt from {', '.join(missing)} within {wait:g} s")
        params, drafter = run["params"], run["drafter"]
        body = {
            "schema": rc.SCHEMA, "model": self.model.model_id, "num_layers": self.model.ckpt.num_layers,
            "client": str(self.node.peer_id), "created": time.time(),
            "prompt_sha256": rc.tokens_hash(run["prompt"]), "prompt_tokens": len(run["prompt"]),
            "output_ids": list(run["output"]), "output_sha256": rc.tokens_hash(run["output"]),
            "sampling": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k},
            "seed": params.seed, "logits_on_last": self.logits_on_last, "wire": self.wire,
            "sessions": [{"session": sid, "sent_chain": final.up.sent_hash.hex(),
                          "received_chain": final.ret.received_hash.hex(),
                          "stages": [base64.b64encode(b).decode() for b in blobs]}],
            "healed_from": [{"session": s.session.hex(), "chain": [c.peer for c in r]} for s, r in hs.entered[:-1]],
            "rtts_ms": {c.peer: round(self.rtt(c.peer) * 1000, 3) for c in route},
            "peer_rtts_ms": {c.peer: {p: round(t * 1000, 3) for p, t in c.rtts} for c in route},
            "tok_per_s": round(stats.tokens_per_s, 3), "prefill_s": round(stats.prefill_s, 4),
            "speculative": None if drafter is None else {
                "drafter": "ngram" if type(drafter).__name__ == "NGramDrafter" else "model",
                "k": run["k"], "depth": run["depth"], "greedy_checked_equal_to_plain": run.get("checked")},
            # honest-compute checks of this run: how many steps were re-run on other peers, with what verdicts
            "checks": None if stats.audit is None else dict(stats.audit.to_json(), rate=self.audit_rate,
                                                            retracted_tokens=stats.retracted),
            "version": __version__,
        }
        return rc.seal_run(self.node.key_pair, body)

    def _recent_claims(self) -> list[Claim] | None:
        """The unexpired claims found moments ago, or None when that was too long ago."""
        if time.time() - self._claims_at >= CLAIM_TTL / 4:
            return None
        return [c for c in self._claims if c.expires > time.time()]

    async def _find_claims(self, timeout: float) -> list[Claim]:
        """Claims from the DHT, remembered for ``_recent_claims``."""
        claims = await find_claims(self.node, self.model.model_id, timeout=timeout)
        self._claims, self._claims_at = claims, time.time()
        return claims

    async def usable_claims(self) -> list[Claim]:
        """Claims of peers this client would route through now (recent ones, else from the DHT)."""
        claims = self._recent_claims()
        return self._usable(claims if claims is not None else await self._find_claims(timeout=5.0), frozenset())

    def _usable(self, claims: list[Claim], avoid) -> list[Claim]:
        now = trio.current_time()
        excluded = self.reputation.excluded()
        return [c for c in claims
                if c.peer not in avoid and c.peer not in excluded and self._avoid.get(c.peer, 0) <= now]

    def rtt(self, peer: str) -> float:
        """Our round trip to ``peer`` (measured, else a guess), relayed links counted several times."""
        rtt = self._rtt.get(peer, (UNKNOWN_RTT, 0.0))[0]
        return rtt * RELAYED_RTT_FACTOR if self.node.link(peer) == "relayed" else rtt

    def hop_cost(self, prev: Claim | None, claim: Claim) -> float:
        """Seconds one token spends reaching and crossing this hop: half the round trip from the
        previous hop (as that peer reported it; ours as a stand-in) plus the peer's compute."""
        reported = dict(prev.rtts).get(claim.peer) if prev is not None else None
        rtt = reported if reported is not None else self.rtt(claim.peer)
        compute = 1.0 / claim.tput if claim.tput > 0 else 0.0
        return (rtt / 2 + compute) * self.reputation.cost_factor(claim.peer)

    def return_cost(self, last: Claim) -> float:
        return self.rtt(last.peer) / 2

    def route_cost(self, route: list[Claim]) -> float:
        prev = None
        total = 0.0
        for c in route:
            total += self.hop_cost(prev, c)
            prev = c
        return total + (self.return_cost(route[-1]) if route else 0.0)

    async def _measure_rtts(self, peers: list[str], *, timeout: float = 2.0, most: int = 64) -> None:
        now = trio.current_time()
        todo = [p for p in dict.fromkeys(peers) if now - self._rtt.get(p, (0.0, -RTT_CACHE_S))[1] >= RTT_CACHE_S]
        pings = await self.node.ping_many(todo[:most], timeout=timeout, samples=RTT_SAMPLES)
        now = trio.current_time()
        for peer, p in pings.items():
            if p.rtt is not None:
                self._rtt[peer] = (p.rtt, now)
            elif p.seconds >= timeout * 0.9:  # there but slow: a costly hop, not a dead one
                self._rtt[peer] = (timeout, now)
            else:  # a claim can outlive its peer in the DHT: leave it out of this and the next plans
                log.info("peer %s does not answer a ping (%s): not routing through it", peer[:16], p.error)
                self.forget_peer(peer, RTT_CACHE_S)

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
                       drafter: Drafter | None = None, k: int = 4, depth: int = 1,
                       progress=None, route: list[Claim] | None = None) -> AsyncIterator[Token]:
        """Yield generated tokens one at a time (text in, text out).

        With a ``drafter`` each chain traversal verifies up to ``k`` drafted tokens: greedy output is
        identical to plain greedy decoding, and sampled output has exactly the distribution of
        plain sampling (lossless speculative sampling). ``depth`` > 1 keeps that many verify chunks
        in flight, drafting ahead on the assumption that earlier chunks are fully accepted; a
        rejection starts a new epoch and the stale chunks are discarded (and dropped by the peers
        that see the newer epoch first). A seed fixes the output whatever the depth and timing.

        When a peer fails mid-request the chain heals (see ``healing``) and generation goes on
        with the same output; ``last_stats.heals`` records each recovery. ``progress``, if given,
        is called as ``progress(event, info)`` for "route", "sent" (each step) and "heal".
        ``route``: a chain just found by ``find_route`` (else one is found here).
        """
        params = SamplingParams(temperature, top_p, top_k, seed)
        if k < 0 or depth < 1:
            raise ShardnetError("need k >= 0 and depth >= 1")
        rng = Randomness(seed)
        ids = self.model.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ShardnetError("empty prompt")
        stats = GenerationStats(prompt_tokens=len(ids))
        route = route or await self.find_route()
        stats.chain = route
        self.last_stats = stats
        if progress is not None:
            progress("route", {"chain": [[c.peer, c.start, c.end] for c in route]})
        if drafter is None:
            k, depth = 0, 1
        extra = (k + 1) * depth  # drafts may run past the end
        sess = HealingSession(self, len(ids) + max_new_tokens + extra, max_heals=self.max_heals,
                              progress=progress, heals=stats.heals)
        out_ids: list[int] = []
        self._last_run = {"prompt": ids, "output": out_ids, "params": params, "stats": stats, "session": sess,
                          "drafter": drafter, "k": k, "depth": depth}
        # checks run beside the generation and end with it (the decode loop waits for those still
        # running before it finishes, so their verdicts still count for this request)
        body_error: BaseException | None = None
        async with trio.open_nursery() as audits:
            if self.audit_rate > 0 and self.fixed_route is None:
                sess.auditor = RunAuditor(self, audits, self.audit_rate)
                stats.audit = sess.auditor.stats
            try:
                await sess.open(route)
                async for tok in generate_on(sess, self.model, ids, params=params, rng=rng, drafter=drafter, k=k,
                                             depth=depth, max_new=max_new_tokens, stop_at_eos=stop_at_eos,
                                             stats=stats, logits_on_last=self.logits_on_last, auditor=sess.auditor):
                    stats.chain = sess.route
                    tok.apply(out_ids)
                    yield tok
            except BaseException as e:  # re-raised below as itself, not inside an exception group
                body_error = e
            finally:
                stats.chain = sess.route or stats.chain
                await sess.close()
                audits.cancel_scope.cancel()  # checks still running when the request failed
        if body_error is not None:
            raise body_error


def _emit(model: LocalModel, out: list[int], tok: int, stats: GenerationStats, t0: float, max_new: int,
          stop_at_eos: bool, retracted: int = 0) -> Token | None:
    """Append an accepted token and return it with its text, or None when generation ends."""
    if stop_at_eos and tok in model.eos_ids or len(out) >= max_new:
        return None
    out.append(tok)
    stats.new_tokens += 1
    stats.decode_s = time.perf_counter() - t0
    # decode incrementally so multi-token characters come out whole
    text = model.decode(out)
    prev = model.decode(out[:-1]) if len(out) > 1 else ""
    return Token(tok, text[len(prev):], retracted)


def _first_wrong(out: list[int], logits: torch.Tensor, params: SamplingParams, rng: Randomness, start: int,
                 speculative: bool) -> tuple[int, int]:
    """Given trusted logits rows [len(out) + 1, vocab] (row i: the distribution of token i of
    ``out``, whose position is ``start + i``): the index of the first token of ``out`` they do
    not support, and the token that belongs there. Greedy and plain sampling are deterministic
    (keyed randomness), so a token is wrong when it differs; speculative sampling made its choices
    with the draft's distributions, so there a token is wrong only when it was impossible."""
    for i, tok in enumerate(out):
        row = logits[i].float()
        if speculative and not params.greedy:
            if probabilities(row, params)[tok] > 0:
                continue
        elif next_token(row, params, rng, start + i) == tok:
            continue
        return i, next_token(row, params, rng, start + i)
    return len(out), next_token(logits[len(out)].float(), params, rng, start + len(out))


async def generate_on(sess: InferenceSession, model: LocalModel, prompt: list[int], *, params: SamplingParams,
                      rng: Randomness, drafter: Drafter | None, k: int, depth: int, max_new: int,
                      stop_at_eos: bool, stats: GenerationStats, logits_on_last: bool = False,
                      auditor: RunAuditor | None = None) -> AsyncIterator[Token]:
    """Prefill ``prompt`` through an open session, then decode with up to ``depth`` verify chunks
    of up to ``k`` drafts in flight. Plain decoding is the case k = 0, depth = 1: each chunk is the
    last token alone. ``sess`` needs only ``send`` and ``receive`` (and, with an ``auditor``, the
    HealingSession's ``exclude`` and ``served_by``).

    With an ``auditor``, between steps and before finishing: when a peer that served this
    session is convicted of computing wrong, the session moves to a chain without it, the whole
    text is sent through the new chain once, and the first token the trusted logits do not
    support is replaced (the tokens after it are retracted; see ``Token``)."""
    t0 = time.perf_counter()
    n = await sess.send(model.head.embed(torch.tensor([prompt])), pos=0)
    got, result = await sess.receive()
    if got != n:
        raise InferenceError("unexpected", f"expected result {n}, got {got}")
    stats.prefill_s = time.perf_counter() - t0
    logits = result[0, -1].float() if logits_on_last else model.head.logits(result[:, -1:])[0, -1]
    first = next_token(logits, params, rng, len(prompt))
    t0 = time.perf_counter()
    spec_stats = stats.speculation
    vocab = model.ckpt.config.vocab_size
    out: list[int] = []
    spec = list(prompt)  # accepted text plus every draft in flight
    # chunks of the current epoch in flight, oldest first; results of older steps are stale
    inflight: deque[_Chunk] = deque()
    epoch, stale_below = 0, 0
    todo = [first]
    retracted = 0
    while True:
        finished = False
        for tok in todo:  # emit accepted tokens
            emitted = _emit(model, out, tok, stats, t0, max_new, stop_at_eos, retracted)
            if emitted is None:
                finished = True
                break
            retracted = 0
            yield emitted
        finished = finished or len(out) >= max_new
        if auditor is not None:
            if finished:
                await auditor.settle()  # a verdict on this request's steps still corrects it
            convicted = [p for p in auditor.take_convicted() if p in sess.served_by()]
            if convicted:
                # the convicted peer's work is not trusted: one pass of the whole text through a
                # chain without it says which of our tokens stand
                await sess.exclude(convicted)
                epoch += 1
                inflight.clear()
                n = await sess.send(model.head.embed(torch.tensor([prompt + out])), pos=0,
                                    logits_for=len(out) + 1, epoch=epoch)
                stale_below = n
                got, result = await sess.receive()
                if got != n:
                    raise InferenceError("unexpected", f"expected result {n}, got {got}")
                rows = result[0].float() if logits_on_last else model.head.logits(result[:, -(len(out) + 1):])[0]
                m, fixed = _first_wrong(out, rows, params, rng, len(prompt), drafter is not None)
                if m < len(out):
                    retracted += len(out) - m
                    stats.new_tokens -= len(out) - m
                    stats.retracted += len(out) - m
                    log.warning("withdrawing %d token(s) computed with a convicted peer", len(out) - m)
                    del out[m:]
                todo = [fixed]
                spec = prompt + out
                continue
        if finished:
            if retracted:  # the corrected text ends where the retraction starts
                yield Token(None, "", retracted)
            return
        if todo:  # the accepted text changed: drafts continue from it
            spec = prompt + out + [d for c in inflight for d in c.drafts]
        todo = []
        # keep `depth` chunks in flight, drafting ahead as if earlier chunks were all accepted
        while len(inflight) < depth and len(spec) - len(prompt) < max_new:
            budget = min(k, max_new - (len(spec) - len(prompt)))
            t_draft = time.perf_counter()
            q = None
            if drafter is None or budget <= 0:
                drafts = []
            elif params.greedy:
                drafts = drafter.propose(spec, budget)
            else:
                drafts, q = drafter.sample(spec, budget, params, rng, vocab)
            spec_stats.draft_s += time.perf_counter() - t_draft
            if not drafts and inflight:
                break  # nothing to speculate on: wait for a result first
            feed = [spec[-1]] + drafts
            n = await sess.send(model.head.embed(torch.tensor([feed])), pos=len(spec) - 1,
                                logits_for=len(feed), epoch=epoch)
            inflight.append(_Chunk(n, epoch, len(spec), drafts, q, time.perf_counter()))
            spec += drafts
            spec_stats.chunks += 1
            if not drafts:
                break
        t_wait = time.perf_counter()
        n, result = await sess.receive()
        while n < stale_below:  # a stale chunk the peers computed anyway
            n, result = await sess.receive()
        spec_stats.wait_s += time.perf_counter() - t_wait
        chunk = inflight.popleft()
        if chunk.n != n:
            raise InferenceError("unexpected", f"result {n} does not match step {chunk.n}")
        spec_stats.round_trip_s += time.perf_counter() - chunk.sent
        logits = result[0].float() if logits_on_last else model.head.logits(result)[0]
        if params.greedy:
            kept = accept_greedy(chunk.drafts, logits.argmax(-1).tolist())
        else:
            p = torch.stack([probabilities(row, params) for row in logits])
            kept = accept_sampled(chunk.drafts, chunk.q, p, rng, chunk.start)
        spec_stats.verified += 1
        spec_stats.drafted += len(chunk.drafts)
        spec_stats.accepted += len(kept) - 1
        if len(kept) == len(chunk.drafts) + 1 and inflight:
            # all accepted: the next chunk in flight verifies what follows, bonus included
            todo = kept[:-1]
            spec_stats.carried += 1
        else:
            todo = kept
            if inflight:
                # everything in flight drafted past a rejection: fence it off. The client forgets
                # those chunks now, so what it does next never depends on whether the peers
                # computed them or dropped them (which is timing): a seed fixes the output.
                epoch += 1
                stale_below = inflight[-1].n + 1
                spec_stats.stale += len(inflight)
                inflight.clear()
        spec_stats.tokens += len(todo)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, (ShardnetError, ap.ActivationProtocolError))

