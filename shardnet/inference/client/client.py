"""The client ("head"): tokenizer, embeddings, final norm and LM head; generation through a chain.

    model = LocalModel("path/to/checkpoint")
    client = Client(node, model)
    async for tok in client.generate("def main(", max_new_tokens=32):
        print(tok.text, end="")

Compute peers see hidden states, never token ids; with ``logits_on_last=True`` the last peer
applies the final norm and LM head and returns logits (for clients too thin to hold the head).

``Client`` ties the pieces to one request: which chain (``RoutePlanner``, route_planner.py), a
session through it that heals (healing.py), the decode loop (decode.py), honest-compute checks
(audit.py) and the run receipt of the last request (run_receipt.py).
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from shardnet.errors import InferenceError, ShardnetError
from shardnet.inference.claims import CLAIM_TTL
from shardnet.inference.client.activity import ClientActivity
from shardnet.inference.client.audit import DEFAULT_AUDIT_RATE, RunAuditor
from shardnet.inference.client.claims_view import ClaimsView
from shardnet.inference.client.decode import GenerationStats, Token, generate_on
from shardnet.inference.client.healing import HealingSession
from shardnet.inference.client.reputation import Reputation
from shardnet.inference.client.route_planner import RoutePlanner, SpanPolicy
from shardnet.inference.client.run_receipt import last_run, seal_run_receipt
from shardnet.inference.client.sampling import Randomness, SamplingParams
from shardnet.inference.client.session import InferenceSession, SessionSlots, _busy
from shardnet.inference.client.speculative import Drafter
from shardnet.inference.client.timing import QUEUE_TIMEOUT
from shardnet.inference.model.block import dtype_name
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.probes import Probes
from shardnet.inference.receipt_service import ReceiptService
from shardnet.inference.router import ActivationRouter
from shardnet.protocols import activation as ap
from shardnet.protocols.activation import ErrorCode
from shardnet.protocols.block_claim import Claim
from shardnet.transport.node import Node

log = logging.getLogger(__name__)


#: whether a client routes through peers whose weights are quantized
QUANTIZED_CHOICES = ("allow", "require", "refuse")


class Client:
    def __init__(self, node: Node, model: LocalModel, *, logits_on_last: bool = False,
                 route: list[Claim] | None = None, route_timeout: float = 30.0, wire: str | None = None,
                 max_heals: int = 5, receipts: bool = True, audit_rate: float = DEFAULT_AUDIT_RATE,
                 queue_timeout: float = QUEUE_TIMEOUT, quantized: str = "allow") -> None:
        self.node, self.model = node, model
        if quantized not in QUANTIZED_CHOICES:
            raise ShardnetError(f"unknown quantized policy {quantized!r} (choose from {', '.join(QUANTIZED_CHOICES)})")
        if wire is not None and wire not in ap.WIRE_DTYPES:
            raise ShardnetError(f"unknown wire dtype {wire!r} (choose from {', '.join(ap.WIRE_DTYPES)})")
        #: how hidden states travel between hops (None: the model's dtype, uncompressed)
        self.wire = wire
        self.logits_on_last = logits_on_last
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
        #: what a run receipt needs of the last ``generate`` (see run_receipt.last_run)
        self._last_run: dict | None = None
        self.last_stats: GenerationStats | None = None
        #: the swarm's claims for this model, shared by every request and client of this node
        #: (kept fresh in the background from now on, unless this client has a fixed route)
        view = ClaimsView.of(node, model.model_id)
        if route is None:
            view.start()
        #: which peers to route through (owns the claims view and the round-trip probes, shared
        #: likewise: one probe per peer at a time, results reused)
        self.planner = RoutePlanner(node, model.ckpt.num_layers, view=view, probes=Probes.of(node),
                                    reputation=self.reputation, fixed_route=route, route_timeout=route_timeout,
                                    policy=SpanPolicy(dtype=dtype_name(model.dtype), quantized=quantized))
        #: sessions per first hop, shared likewise: more wait in line (see ``session``)
        self.slots = SessionSlots.of(node)
        self.queue_timeout = queue_timeout
        ActivationRouter.of(node)  # accept the chain's direct return
        ClientActivity.of(node)  # (monitors see this node's client counters from the start)

    # Routing is the planner's (see route_planner.py); these delegate to it.

    @property
    def view(self) -> ClaimsView:
        return self.planner.view

    @property
    def probes(self) -> Probes:
        return self.planner.probes

    @property
    def fixed_route(self) -> list[Claim] | None:
        return self.planner.fixed_route

    @fixed_route.setter
    def fixed_route(self, route: list[Claim] | None) -> None:
        self.planner.fixed_route = route

    @property
    def route_timeout(self) -> float:
        return self.planner.route_timeout

    @route_timeout.setter
    def route_timeout(self, seconds: float) -> None:
        self.planner.route_timeout = seconds

    @property
    def _avoid(self) -> dict[str, tuple[float, float]]:
        return self.planner._avoid

    def forget_peer(self, peer: str, seconds: float = CLAIM_TTL) -> None:
        self.planner.forget_peer(peer, seconds)

    async def find_route(self, *, timeout: float | None = None, avoid: set[str] | frozenset = frozenset(),
                         keep: list[Claim] | None = None) -> list[Claim]:
        return await self.planner.find_route(timeout=timeout, avoid=avoid, keep=keep)

    async def usable_claims(self) -> list[Claim]:
        return await self.planner.usable_claims()

    def _usable(self, claims: list[Claim], avoid) -> list[Claim]:
        return self.planner.usable(claims, avoid)

    def rtt(self, peer: str) -> float:
        return self.planner.rtt(peer)

    def hop_cost(self, prev: Claim | None, claim: Claim) -> float:
        return self.planner.hop_cost(prev, claim)

    def return_cost(self, last: Claim) -> float:
        return self.planner.return_cost(last)

    def route_cost(self, route: list[Claim]) -> float:
        return self.planner.route_cost(route)

    async def _measure_rtts(self, peers: list[str], *, timeout: float = 2.0, most: int = 64) -> None:
        await self.planner.measure_rtts(peers, timeout=timeout, most=most)

    async def run_receipt(self, *, wait: float = 10.0) -> dict:
        """The last ``generate``'s run receipt, signed by this node's key: JSON-ready (see
        protocols/receipts.py). Fetches each peer's stage receipt of the final session."""
        return await seal_run_receipt(self, self._last_run, wait=wait)

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
                # routing counts this session's KV on its hops until it closes (own_load.py)
                with self.planner.own_load.holding(route, max_len):
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
                    raise InferenceError(ErrorCode.BUSY, f"the chain stayed busy for {self.queue_timeout:g} s: {e}",
                                         e.peer) from None
                log.info("chain busy (%s); trying again in %.1f s", e, delay)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await sess.close()
                raise
            await trio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(2.0, delay * 2)

    async def generate(self, prompt: str | list[int], max_new_tokens: int = 32, *, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                       frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                       logit_bias: dict[int, float] | None = None, logprobs: int | None = None,
                       stop_at_eos: bool = True,
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
        ``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` ({token: bias}) adjust the
        logits before each choice as OpenAI defines them (sampling.adjusted). With ``logprobs``
        (a number of alternatives, 0 for none) each token carries its log-probability and theirs.
        """
        params = SamplingParams(temperature, top_p, top_k, seed, frequency_penalty, presence_penalty,
                                _checked_bias(logit_bias, self.model.ckpt.config.vocab_size))
        if k < 0 or depth < 1:
            raise ShardnetError("need k >= 0 and depth >= 1")
        rng = Randomness(seed)
        ids = self.model.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ShardnetError("empty prompt")
        stats = GenerationStats(prompt_tokens=len(ids))
        activity = ClientActivity.of(self.node)
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
        heals_seen = 0

        def round_trip(seconds: float, tokens: int) -> None:
            nonlocal heals_seen
            activity.step(seconds)
            # a token alone in flight, through a chain that did not change on the way: what the
            # chain's peers claim is weighed against it (peer_speeds.py)
            if tokens == 1 and depth == 1 and len(stats.heals) == heals_seen and sess.route:
                self.planner.observe_step(sess.route, seconds)
            heals_seen = len(stats.heals)

        stats.speculation.on_round_trip = round_trip
        out_ids: list[int] = []
        self._last_run = last_run(prompt=ids, output=out_ids, params=params, stats=stats, session=sess,
                                  drafter=drafter, k=k, depth=depth)
        # checks run beside the generation and end with it (the decode loop waits for those still
        # running before it finishes, so their verdicts still count for this request)
        body_error: BaseException | None = None
        told_heals = 0

        def tell_heals() -> None:
            nonlocal told_heals
            for heal in stats.heals[told_heals:]:
                activity.healed(heal.to_json())
            told_heals = len(stats.heals)

        activity.session_started(len(ids))
        async with trio.open_nursery() as audits:
            if self.audit_rate > 0 and self.fixed_route is None:
                sess.auditor = RunAuditor(self, audits, self.audit_rate)
                stats.audit = sess.auditor.stats
            try:
                await sess.open(route)
                async for tok in generate_on(sess, self.model, ids, params=params, rng=rng, drafter=drafter, k=k,
                                             depth=depth, max_new=max_new_tokens, stop_at_eos=stop_at_eos,
                                             stats=stats, logits_on_last=self.logits_on_last, auditor=sess.auditor,
                                             logprobs=logprobs):
                    stats.chain = sess.route
                    tok.apply(out_ids)
                    activity.token(made=tok.id is not None, retracted=tok.retracted)
                    tell_heals()
                    yield tok
            except BaseException as e:  # re-raised below as itself, not inside an exception group
                body_error = e
            finally:
                stats.chain = sess.route or stats.chain
                tell_heals()
                activity.session_ended(failed=body_error is not None and not isinstance(body_error, GeneratorExit)
                                       and not isinstance(body_error, trio.Cancelled), audit=stats.audit)
                await sess.close()
                audits.cancel_scope.cancel()  # checks still running when the request failed
        if body_error is not None:
            raise body_error


def _checked_bias(bias: dict[int, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """A logit bias as SamplingParams holds it, its tokens checked against the vocabulary."""
    out = []
    for token, b in sorted((bias or {}).items()):
        if not 0 <= int(token) < vocab:
            raise ShardnetError(f"logit_bias: token {token} is not in the model's vocabulary (0..{vocab - 1})")
        out.append((int(token), float(b)))
    return tuple(out)
