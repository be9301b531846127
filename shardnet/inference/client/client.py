"""The client ("head"): tokenizer, embeddings, final norm and LM head; generation through a chain.

    model = LocalModel("path/to/checkpoint")
    client = Client(node, model)
    async for tok in client.generate("def main(", max_new_tokens=32):
        print(tok.text, end="")

Compute peers see hidden states, never token ids; with ``logits_on_last=True`` the last peer
applies the final norm and LM head and returns logits (for clients too thin to hold the head).

``Client`` ties the pieces to one request: which chain (its ``planner``, route_planner.py), a
session through it that heals (healing.py), the decode loop (decode.py), honest-compute checks
(audit.py) and the run receipt of the last request (run_receipt.py). Those get the client's
``request`` (``RequestContext``, request.py: the node, the model, the planner, the node's session
slots and the chain's settings), never the client itself. Routing is asked of ``client.planner``
directly. What every client of a node shares (probes, session slots, own load, activity, metrics)
is the node's ``InferenceServices`` (inference/services.py), taken once here and handed on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import EllipsisType

import trio

from shardnet.errors import HeldError, ShardnetError
from shardnet.inference.client.activity import ClientActivity
from shardnet.inference.client.audit import DEFAULT_AUDIT_RATE, RunAuditor
from shardnet.inference.client.auto_drafter import AutoDrafter
from shardnet.inference.claims_view import ClaimsView
from shardnet.inference.client.decode import GenerationStats, Token, generate_on
from shardnet.inference.client.healing import Heal, HealingSession
from shardnet.inference.client.reputation import Reputation
from shardnet.inference.client.request import RequestContext
from shardnet.inference.client.route_planner import RoutePlanner, SpanPolicy
from shardnet.inference.client.run_receipt import last_run, seal_run_receipt
from shardnet.inference.client.sampling import Randomness, SamplingParams
from shardnet.inference.client.session import InferenceSession, open_session
from shardnet.inference.client.speculative import Drafter
from shardnet.inference.client.throughput import TREE_MAX_K, TreeShaper
from shardnet.inference.client.timing import QUEUE_TIMEOUT
from shardnet.inference.model.block import dtype_name
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.receipt_service import ReceiptService
from shardnet.inference.router import ActivationRouter
from shardnet.inference.services import inference_services
from shardnet.protocols import activation as ap
from shardnet.protocols.block_claim import Claim
from shardnet.transport.node import Node

#: whether a client routes through peers whose weights are quantized
QUANTIZED_CHOICES = ("allow", "require", "refuse")


def _checked_prefix(prefix: str | None) -> str | None:
    if prefix is not None and not 0 < len(prefix) <= ap.MAX_PREFIX_SCOPE:
        raise ShardnetError(f"a prefix scope has 1 to {ap.MAX_PREFIX_SCOPE} characters")
    return prefix


class Client:
    def __init__(self, node: Node, model: LocalModel, *, logits_on_last: bool = False,
                 route: list[Claim] | None = None, route_timeout: float = 30.0, wire: str | None = None,
                 max_heals: int = 5, receipts: bool = True, audit_rate: float = DEFAULT_AUDIT_RATE,
                 queue_timeout: float = QUEUE_TIMEOUT, quantized: str = "allow", prefix: str | None = None) -> None:
        self.node, self.model = node, model
        if quantized not in QUANTIZED_CHOICES:
            raise ShardnetError(f"unknown quantized policy {quantized!r} (choose from {', '.join(QUANTIZED_CHOICES)})")
        if wire is not None and wire not in ap.WIRE_DTYPES:
            raise ShardnetError(f"unknown wire dtype {wire!r} (choose from {', '.join(ap.WIRE_DTYPES)})")
        _checked_prefix(prefix)
        self.max_heals = max_heals
        #: what this node's clients (and its compute peer) share: probes, session slots, own load,
        #: activity counters and metrics (made with the first client, which monitors see from then on)
        self.services = services = inference_services(node)
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
        #: per set of candidates, the last greedy generation's AutoDrafter: the next one over the
        #: same candidates starts from its figures
        self._auto_priors: dict[tuple[str, ...], AutoDrafter] = {}
        #: the tree shaper of the last generation that sent trees (the next one starts from it)
        self.tree_shaper: TreeShaper | None = None
        #: the swarm's claims for this model, shared by every request and client of this node
        #: (kept fresh in the background from now on, unless this client has a fixed route)
        view = ClaimsView.of(node, model.model_id, services.probes, num_layers=model.ckpt.num_layers)
        if route is None:
            view.start()
        #: which peers to route through (holds the claims view, the round-trip probes and the own
        #: load, shared likewise: one probe per peer at a time, results reused); ask it for routes
        self.planner = RoutePlanner(node, model.ckpt.num_layers, view=view, probes=services.probes,
                                    own_load=services.own_load, reputation=self.reputation, fixed_route=route,
                                    route_timeout=route_timeout,
                                    policy=SpanPolicy(dtype=dtype_name(model.dtype), quantized=quantized))
        #: what sessions, healing, checks and receipts need of this client (``wire``: how hidden
        #: states travel between hops, None for the model's dtype; ``receipts``: keep what a run
        #: receipt needs; ``queue_timeout``: how long a request waits in line for a busy chain)
        self.request = RequestContext(node, model, self.planner, services.session_slots, wire=wire,
                                      logits_on_last=logits_on_last, receipts=receipts, queue_timeout=queue_timeout,
                                      prefix=prefix)
        ActivationRouter.of(node)  # accept the chain's direct return

    async def run_receipt(self, *, wait: float = 10.0) -> dict:
        """The last ``generate``'s run receipt, signed by this node's key: JSON-ready (see
        protocols/receipts.py). Fetches each peer's stage receipt of the final session."""
        return await seal_run_receipt(self.request, self._last_run, wait=wait)

    def session(self, max_len: int,
                route: list[Claim] | None = None) -> AbstractAsyncContextManager[InferenceSession]:
        """An open chain session (``async with``), waiting in line while the chain is busy (see
        ``session.open_session``)."""
        return open_session(self.request, max_len, route)

    async def generate(self, prompt: str | list[int], max_new_tokens: int = 32, *, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                       frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                       logit_bias: dict[int, float] | None = None, logprobs: int | None = None,
                       stop_at_eos: bool = True,
                       drafter: Drafter | None = None, k: int | None = None, depth: int = 1, tree: bool = True,
                       branches: int | None = None,
                       progress=None, route: list[Claim] | None = None,
                       prefix: str | None | EllipsisType = ...) -> AsyncIterator[Token]:
        """Yield generated tokens one at a time (text in, text out).

        With a ``drafter`` each chain traversal verifies up to ``k`` (default 4) drafted tokens: greedy output is
        identical to plain greedy decoding, and sampled output has exactly the distribution of
        plain sampling (lossless speculative sampling). ``depth`` > 1 keeps that many verify chunks
        in flight, drafting ahead on the assumption that earlier chunks are fully accepted; a
        rejection starts a new epoch and the stale chunks are discarded (and dropped by the peers
        that see the newer epoch first). A seed fixes the output whatever the depth and timing.
        An ``AutoDrafter`` of a greedy generation starts from the figures of this client's last
        greedy generation over the same candidates (``AutoDrafter.start_from``).
        ``tree`` (default): decoding one chunk at a time without penalties verifies trees of
        drafts where the drafter makes them (a draft model: its chain and, greedy, its second
        choices, sampling, a second draw beside each draft: lossless) and every peer of the chain
        takes them (``decode.generate_on``); False: chains only. Each tree's shape is
        chosen from the measured acceptance and trips (``throughput.TreeShaper``, going on from
        this client's previous generation: up to ``k``, default 12, drafts in its chain and as
        many branches), or fixed with ``branches``: a chain of ``k`` and ``branches`` beside it.
        With sampling the shape is fixed (``k`` and ``k``, default 4), so that a seed fixes the
        output (a shape chosen from trip times would make it depend on timing; a heal onto a
        chain of older peers that take no trees sends chains, which use the numbers otherwise).

        When a peer fails mid-request the chain heals (see ``healing``) and generation goes on
        with the same output; ``last_stats.heals`` records each recovery. ``progress``, if given,
        is called as ``progress(event, info)`` for "route", "sent" (each step) and "heal".
        ``route``: a chain just found by ``planner.find_route`` (else one is found here).
        ``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` ({token: bias}) adjust the
        logits before each choice as OpenAI defines them (sampling.adjusted). With ``logprobs``
        (a number of alternatives, 0 for none) each token carries its log-probability and theirs.
        ``prefix``: this request's prefix reuse scope (default: the client's; see ``RequestContext``).
        """
        params = SamplingParams(temperature, top_p, top_k, seed, frequency_penalty, presence_penalty,
                                _checked_bias(logit_bias, self.model.ckpt.config.vocab_size))
        if k is not None and k < 0 or branches is not None and branches < 0:
            raise ShardnetError("need k >= 0 and branches >= 0")
        tree_k = TREE_MAX_K if k is None else k
        k = 4 if k is None else k
        ids = self._checked_prompt(prompt, k, depth)
        stats = GenerationStats(prompt_tokens=len(ids))
        route = await self._route(route, stats, progress)
        if drafter is None:
            k, depth, tree_k, tree = 0, 1, 0, False
        elif isinstance(drafter, AutoDrafter) and tuple(drafter.candidates) in self._auto_priors and not drafter.chunks:
            drafter.start_from(self._auto_priors[tuple(drafter.candidates)])  # (greedy only: see start_from)
        request = self.request if prefix is ... else dataclasses.replace(self.request, prefix=_checked_prefix(prefix))
        if branches is None and not params.greedy:  # (a shape chosen from trip times: output by timing)
            tree_k = branches = k
        shaper = TreeShaper(tree_k, fixed=None if branches is None else (tree_k, min(branches, tree_k)))
        if self.tree_shaper is not None:
            shaper.start_from(self.tree_shaper)
        # drafts may run past the end (a tree's: its chain and as many branches beside it)
        room = max((k + 1) * depth, 2 * tree_k + 1 if tree and depth == 1 else 0)
        sess = HealingSession(request, len(ids) + max_new_tokens + room, max_heals=self.max_heals,
                              progress=progress, heals=stats.heals)
        activity = self.services.activity
        stats.speculation.on_round_trip = _RoundTrips(activity, self.planner, stats, sess, depth)
        out_ids: list[int] = []
        self._last_run = last_run(prompt=ids, output=out_ids, params=params, stats=stats, session=sess,
                                  drafter=drafter, k=k, depth=depth, audit_rate=self.audit_rate)
        heals = _HealReports(activity, stats.heals)
        async with self._running(sess, stats, activity, heals):
            await sess.open(route)
            async for tok in generate_on(sess, self.model, ids, params=params, rng=Randomness(seed), drafter=drafter,
                                         k=k, depth=depth, max_new=max_new_tokens, stop_at_eos=stop_at_eos,
                                         stats=stats, logits_on_last=self.request.logits_on_last,
                                         auditor=sess.auditor, logprobs=logprobs,
                                         tree=shaper if tree else False):
                stats.chain = sess.route
                tok.apply(out_ids)
                activity.token(made=tok.id is not None, retracted=tok.retracted)
                heals.tell()
                yield tok
        if isinstance(drafter, AutoDrafter) and drafter.greedy and drafter.chunks:
            self._auto_priors[tuple(drafter.candidates)] = drafter
        if stats.speculation.trees:
            self.tree_shaper = shaper

    def _checked_prompt(self, prompt: str | list[int], k: int, depth: int) -> list[int]:
        """The prompt's token ids, once the speculation settings are checked too."""
        if k < 0 or depth < 1:
            raise ShardnetError("need k >= 0 and depth >= 1")
        ids = self.model.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ShardnetError("empty prompt")
        return ids

    async def _route(self, route: list[Claim] | None, stats: GenerationStats, progress) -> list[Claim]:
        """The request's first chain (``route``, else the planner's), recorded in ``stats``, which
        become ``last_stats``, and told to ``progress``."""
        route = route or await self.planner.find_route()
        stats.chain = route
        self.last_stats = stats
        if progress is not None:
            progress("route", {"chain": [[c.peer, c.start, c.end] for c in route]})
        return route

    @asynccontextmanager
    async def _running(self, sess: HealingSession, stats: GenerationStats, activity: ClientActivity,
                       heals: _HealReports) -> AsyncIterator[None]:
        """A request's life around its decode loop: the activity counters, honest-compute checks
        beside it (they end with it: the decode loop waits for those still running before it
        finishes, so their verdicts still count for this request), the session closed at the end,
        and the loop's error re-raised as itself, not inside an exception group."""
        held = HeldError()  # re-raised below as itself, not inside an exception group
        activity.session_started(stats.prompt_tokens)
        async with trio.open_nursery() as audits:
            if self.audit_rate > 0 and self.planner.fixed_route is None:
                sess.auditor = RunAuditor(self.request, audits, self.audit_rate)
                stats.audit = sess.auditor.stats
            try:
                with held:
                    yield
            finally:
                stats.chain = sess.route or stats.chain
                heals.tell()
                activity.session_ended(failed=held.error is not None and not isinstance(held.error, GeneratorExit)
                                       and not isinstance(held.error, trio.Cancelled), audit=stats.audit)
                await sess.close()
                audits.cancel_scope.cancel()  # checks still running when the request failed
        held.reraise()


class _RoundTrips:
    """Each chain step's round trip: counted for monitors and, for a token alone in flight
    through a chain that did not change on the way, weighed against what the chain's peers
    claim (``RoutePlanner.observe_step``, peer_speeds.py)."""

    def __init__(self, activity: ClientActivity, planner: RoutePlanner, stats: GenerationStats,
                 sess: HealingSession, depth: int) -> None:
        self.activity, self.planner, self.stats, self.sess, self.depth = activity, planner, stats, sess, depth
        self.heals_seen = 0

    def __call__(self, seconds: float, tokens: int) -> None:
        self.activity.step(seconds)
        if tokens == 1 and self.depth == 1 and len(self.stats.heals) == self.heals_seen and self.sess.route:
            self.planner.observe_step(self.sess.route, seconds)
        self.heals_seen = len(self.stats.heals)


class _HealReports:
    """Tells the node's client activity of each recovery of a request, once."""

    def __init__(self, activity: ClientActivity, heals: list[Heal]) -> None:
        self.activity, self.heals, self.told = activity, heals, 0

    def tell(self) -> None:
        for heal in self.heals[self.told:]:
            self.activity.healed(heal.to_json())
        self.told = len(self.heals)


def _checked_bias(bias: dict[int, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """A logit bias as SamplingParams holds it, its tokens checked against the vocabulary."""
    out = []
    for token, b in sorted((bias or {}).items()):
        if not 0 <= int(token) < vocab:
            raise ShardnetError(f"logit_bias: token {token} is not in the model's vocabulary (0..{vocab - 1})")
        out.append((int(token), float(b)))
    return tuple(out)
