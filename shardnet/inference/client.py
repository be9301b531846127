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
import random
import re
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
from .claims import CLAIM_TTL, RTT_SAMPLES, ClaimsView, NoRouteError
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
from .probes import Probes
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


#: route cost of a hop whose round trip we could not measure (seconds)
UNKNOWN_RTT = 0.05
#: a relayed hop's round trip counts this many times (every byte crosses the relay twice)
RELAYED_RTT_FACTOR = 3.0
#: how much cheaper a peer already in the chain looks when a chain heals (keep what works)
KEEP_DISCOUNT = 0.25
RTT_CACHE_S = 30.0
#: route cost of a hop whose peer is there but did not answer a probe in time (seconds)
SLOW_RTT = 2.0
#: refusals that mean "not now": the request waits and tries again (see ``Client.session``)
BUSY = frozenset({"too_many_sessions", "rate_limited", "kv_budget"})
#: how long a request waits in line for a session before it fails with code "busy" (seconds)
QUEUE_TIMEOUT = 60.0


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


class Client:
    def __init__(self, node: Node, model: LocalModel, *, logits_on_last: bool = False,
                 route: list[Claim] | None = None, route_timeout: float = 30.0, wire: str | None = None,
                 max_heals: int = 5, receipts: bool = True, audit_rate: float = DEFAULT_AUDIT_RATE,
                 queue_timeout: float = QUEUE_TIMEOUT) -> None:
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
        #: peer -> (until (trio time), the expiry of its claim then): failed during a request
        self._avoid: dict[str, tuple[float, float]] = {}
        #: the swarm's claims for this model, shared by every request and client of this node
        #: (kept fresh in the background from now on, unless this client has a fixed route)
        self.view = ClaimsView.of(node, model.model_id)
        if route is None:
            self.view.start()
        #: round-trip probes, shared likewise (one probe per peer at a time, results reused)
        self.probes = Probes.of(node)
        #: sessions per first hop, shared likewise: more wait in line (see ``session``)
        self.slots = SessionSlots.of(node)
        self.queue_timeout = queue_timeout
        ActivationEndpoint.of(node)  # accept the chain's direct return

    def forget_peer(self, peer: str, seconds: float = CLAIM_TTL) -> None:
        """Route around ``peer`` for a while (its claim may outlive it in the DHT), or until it
        signs a newer claim: a peer that restarted and claimed its layers again is back."""
        claim = self.view.get(peer)
        self._avoid[peer] = (trio.current_time() + seconds, claim.expires if claim else time.time() + CLAIM_TTL)

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
        view = self.view
        view.start()
        if view.running and not view.first_lookup.is_set():
            # A new view fills from gossip claim by claim: the first route is chosen from what a
            # whole lookup sees, not from whichever claims happened to arrive first.
            with trio.move_on_after(max(0.0, deadline - trio.current_time())):
                await view.first_lookup.wait()
        while True:
            if not view.running:  # a node without a nursery of its own: look up here
                await view.lookup(timeout=max(1.0, min(15.0, deadline - trio.current_time())))
            claims = view.current()
            try:
                usable = self._usable(claims, avoid)
                plan_route(usable, self.model.ckpt.num_layers)  # fail fast, before measuring anything
                await self._measure_rtts([c.peer for c in usable])
                usable = self._usable(claims, avoid)  # without the peers found gone

                def cost(prev: Claim | None, c: Claim) -> float:
                    return self.hop_cost(prev, c) * (KEEP_DISCOUNT if c.peer in kept else 1.0)

                route = plan_route(usable, self.model.ckpt.num_layers, cost=cost, finish=self.return_cost)
                log.info("route: %s (estimated %.1f ms per token)",
                         " -> ".join(f"{c.peer[:12]}…[{c.start}:{c.end}]" for c in route),
                         1000 * self.route_cost(route))
                return route
            except NoRouteError as e:
                last_error = e
            left = deadline - trio.current_time()
            if left <= 0:
                why = f"; {view.last_lookup_error}" if view.last_lookup_error and not claims else ""
                raise NoRouteError(f"after {timeout:g} s: {last_error}{why}")
            # a fresh lookup (one for every request waiting, at most one per LOOKUP_GAP_S), and
            # whatever gossip brings meanwhile
            view.kick()
            if view.running:
                await view.wait_changed(min(1.0, left))
            else:
                await trio.sleep(min(1.0, left))

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

    async def usable_claims(self) -> list[Claim]:
        """Claims of peers this client would route through now."""
        self.view.start()
        if not self.view.running:
            await self.view.lookup(timeout=5.0)
        elif not self.view.lookups:
            await self.view.wait_changed(5.0)
        return self._usable(self.view.current(), frozenset())

    def _usable(self, claims: list[Claim], avoid) -> list[Claim]:
        now = trio.current_time()
        excluded = self.reputation.excluded()
        out = []
        for c in claims:
            if c.peer in avoid or c.peer in excluded or self.probes.verdict(c.peer) == "gone":
                continue
            until, expiry_then = self._avoid.get(c.peer, (0.0, 0.0))
            if until > now and c.expires <= expiry_then:
                continue  # failed during a request and has not claimed again since
            out.append(c)
        return out

    def rtt(self, peer: str) -> float:
        """Our round trip to ``peer`` (measured, else a guess), relayed links counted several times."""
        rtt = SLOW_RTT if self.probes.verdict(peer) == "slow" else self.probes.rtts.get(peer, UNKNOWN_RTT)
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
        """Probe the peers not probed lately (shared with every other request; see probes.py). A
        peer that cannot be reached is left out of routes until it claims again or ``GONE_S``
        passes; one that is there but does not answer in time is a costly hop (``SLOW_RTT``)."""
        await self.probes.probe(list(dict.fromkeys(peers))[:most], max_age=RTT_CACHE_S, timeout=timeout,
                                samples=RTT_SAMPLES)

    @asynccontextmanager
    async def session(self, max_len: int, route: list[Claim] | None = None) -> AsyncIterator[InferenceSession]:
        """An open chain session. Over ``sessions_out_per_peer`` sessions at the first hop, or
        refused as busy by a hop (its ``sessions_per_peer``, session rate or KV budget), the
        request waits in line and tries again, up to ``queue_timeout``; then InferenceError
        "busy". Queueing is what a user of an overloaded server expects (requests take longer,
        none fail); failing at once would hand every caller a retry loop of its own, and retrying
        without a line would let the last comer overtake those waiting. Slots are kept here,
        where the requests are (the client knows its own sessions; a peer only sees that one
        upstream peer holds too many), and a hop's refusal further down the chain, which no
        client-side count can foresee, is waited out with a jittered backoff."""
        route = route or await self.find_route()
        deadline = trio.current_time() + self.queue_timeout
        async with self.slots.hold(route[0].peer, deadline):
            sess = await self._open_when_free(route, max_len, deadline)
            body_error: BaseException | None = None
            try:
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

    async def _open_when_free(self, route: list[Claim], max_len: int, deadline: float) -> InferenceSession:
        delay = 0.1
        while True:
            sess = InferenceSession(self, route, max_len)
            try:
                await sess._open()
                return sess
            except InferenceError as e:
                with trio.CancelScope(shield=True):
                    await sess.close()
                if not _busy(e):
                    raise
                if trio.current_time() + delay >= deadline:
                    raise InferenceError("busy", f"the chain stayed busy for {self.queue_timeout:g} s: {e}",
                                         e.peer) from None
                log.info("chain busy (%s); trying again in %.1f s", e, delay)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await sess.close()
                raise
            await trio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(2.0, delay * 2)

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

