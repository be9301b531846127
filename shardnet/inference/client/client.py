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
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from shardnet import __version__
from shardnet.errors import InferenceError, NoRouteError
from shardnet.inference.claims import CLAIM_TTL, RTT_SAMPLES
from shardnet.inference.client.audit import DEFAULT_AUDIT_RATE, RunAuditor
from shardnet.inference.client.claims_view import ClaimsView
from shardnet.inference.client.decode import GenerationStats, Token, generate_on
from shardnet.inference.client.healing import HealingSession
from shardnet.inference.client.reputation import Reputation
from shardnet.inference.client.routing import plan_route
from shardnet.inference.client.sampling import Randomness, SamplingParams
from shardnet.inference.client.session import InferenceSession, SessionSlots, _busy
from shardnet.inference.client.speculative import Drafter
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.probes import Probes
from shardnet.inference.receipt_service import ReceiptService
from shardnet.inference.router import ActivationRouter
from shardnet.protocols import activation as ap
from shardnet.protocols import receipts as rc
from shardnet.protocols.block_claim import Claim
from shardnet.transport.errors import ShardnetError
from shardnet.transport.node import Node

log = logging.getLogger(__name__)


#: route cost of a hop whose round trip we could not measure (seconds)
UNKNOWN_RTT = 0.05
#: a relayed hop's round trip counts this many times (every byte crosses the relay twice)
RELAYED_RTT_FACTOR = 3.0
#: how much cheaper a peer already in the chain looks when a chain heals (keep what works)
KEEP_DISCOUNT = 0.25
RTT_CACHE_S = 30.0
#: route cost of a hop whose peer is there but did not answer a probe in time (seconds)
SLOW_RTT = 2.0
#: how long a request waits in line for a session before it fails with code "busy" (seconds)
QUEUE_TIMEOUT = 60.0


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
        ActivationRouter.of(node)  # accept the chain's direct return

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
        from shardnet.inference.receipt_service import fetch_session_receipts

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


