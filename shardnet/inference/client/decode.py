"""The decode loop: prefill, then plain or speculative decoding with verify chunks in flight."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shardnet.errors import InferenceError
from shardnet.inference.client.audit import AuditStats, RunAuditor
from shardnet.inference.client.head_batcher import head_batcher
from shardnet.inference.client.healing import Heal
from shardnet.inference.client.sampling import (
    Randomness,
    SamplingParams,
    adjusted,
    next_token,
    probabilities,
)
from shardnet.inference.client.speculative import (
    Drafter,
    SpeculationStats,
    accept_greedy,
    accept_greedy_tree,
    accept_sampled,
    accept_sampled_tree,
)
from shardnet.inference.client.throughput import TreeShaper
from shardnet.protocols.activation import MAX_TREE_TOKENS, ErrorCode
from shardnet.protocols.block_claim import Claim

if TYPE_CHECKING:
    from shardnet.inference.client.session import InferenceSession
    from shardnet.inference.model.local_model import LocalModel

log = logging.getLogger(__name__)


@dataclass
class Token:
    """A generated token. ``retracted`` > 0: the last ``retracted`` tokens before this one are
    withdrawn (a peer that computed them was caught computing wrong; this one replaces them). When
    the corrected text ends right there, a last Token with ``id`` None carries the retraction."""

    id: int | None
    text: str
    retracted: int = 0
    #: with ``logprobs`` asked for: this token's log-probability, and the most likely tokens'
    #: (id, log-probability), most likely first, in the distribution it was chosen from (the
    #: model's, after penalties and bias, before temperature and top-p)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()

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
    by: str | None = None  # which drafter drafted it (a drafter that chooses: auto_drafter.py)
    parents: list[int] | None = None  # a tree of drafts: each draft's parent (-1: the text)
    heals: int = 0  # the session's heals when it was sent (a trip that spans a heal is not a trip's cost)
    send_s: float = 0.0  # a tree's: the client's time from its drafts to its send (embedding, framing)


def _logprobs(row: torch.Tensor, tok: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``tok``'s log-probability in ``row``'s distribution, and the ``top`` most likely tokens'."""
    lp = torch.log_softmax(row.float(), dim=-1)
    best = torch.topk(lp, min(top, lp.shape[-1])) if top > 0 else None
    alts = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return float(lp[tok]), alts


def _first_wrong(out: list[int], logits: torch.Tensor, params: SamplingParams, rng: Randomness, start: int,
                 drafted_at: set[int] = frozenset()) -> tuple[int, int]:
    """Given trusted logits rows [len(out) + 1, vocab] (row i: the distribution of token i of
    ``out``, whose position is ``start + i``): the index of the first token of ``out`` they do
    not support, and the token that belongs there. Greedy and plain sampling are deterministic
    (keyed randomness), so a token is wrong when it differs; a sampled token accepted from a
    chunk with drafts (its index in ``drafted_at``) may have been chosen with the draft's
    distributions, so it is wrong only when it was impossible."""
    for i, tok in enumerate(out):
        row = logits[i].float()
        if i in drafted_at and not params.greedy:
            if probabilities(row, params)[tok] > 0:
                continue
        elif next_token(row, params, rng, start + i) == tok:
            continue
        return i, next_token(row, params, rng, start + i)
    return len(out), next_token(logits[len(out)].float(), params, rng, start + len(out))


async def generate_on(sess: InferenceSession, model: LocalModel, prompt: list[int], *, params: SamplingParams,
                      rng: Randomness, drafter: Drafter | None, k: int, depth: int, max_new: int,
                      stop_at_eos: bool, stats: GenerationStats, logits_on_last: bool = False,
                      auditor: RunAuditor | None = None, logprobs: int | None = None,
                      tree: bool | TreeShaper = False) -> AsyncIterator[Token]:
    """Prefill ``prompt`` through an open session, then decode with up to ``depth`` verify chunks
    of up to ``k`` drafts in flight. Plain decoding is the case k = 0, depth = 1: each chunk is the
    last token alone. ``sess`` needs only ``send`` and ``receive`` (and, with an ``auditor``, the
    HealingSession's ``exclude`` and ``served_by``).

    With an ``auditor``, between steps and before finishing: when a peer that served this
    session is convicted of computing wrong, the session moves to a chain without it, the whole
    text is sent through the new chain once, and the first token the trusted logits do not
    support is replaced (the tokens after it are retracted; see ``Token``).

    With ``logprobs`` (a number of alternatives, 0 for none) each token carries its log-probability
    and the ``logprobs`` most likely tokens' (``Token.logprob``, ``Token.top_logprobs``).

    ``tree``: verify trees of drafts (the drafter's ``propose_tree``: a draft model's chain and
    its second choices beside it; drafters with ``drafts_trees``) instead of chains, while one
    chunk is in flight (``depth`` 1), no penalty counts earlier tokens and the session's chain
    takes tree steps (its ``trees``); each traversal then keeps the longest path the target
    accepts (greedy: agrees with; sampling: ``accept_sampled_tree``, lossless, over a second
    draw beside each chain draft, ``sample_tree``), and the next step tells the peers to keep it
    (``keep``) in place of the tree. Each tree's shape
    is the ``TreeShaper``'s (True: one that chooses up to ``k`` drafts in the chain and as many
    branches from this generation's measured acceptance and trips)."""
    steps = _Steps(sess, model, logits_on_last)
    t0 = time.perf_counter()
    result = await steps.prefill(prompt)
    stats.prefill_s = time.perf_counter() - t0
    first_row = adjusted(await steps.logits(result, rows=1), params, [], [])[-1]
    first = next_token(first_row, params, rng, len(prompt))
    text = _Text(model, prompt, max_new, stop_at_eos, stats)
    pipe = _Pipeline(steps, prompt, params, rng, drafter, k, depth, max_new, stats.speculation, tree=tree)
    todo = [first]  # accepted tokens not yet emitted
    rows = [first_row]  # the logits each was chosen from (row i: todo[i])
    while True:
        # emit: until EOS or max_new
        finished = False
        for tok, row in zip(todo, rows):
            token = text.emit(tok)
            if token is None:
                finished = True
                break
            if logprobs is not None:
                token.logprob, token.top_logprobs = _logprobs(row, tok, logprobs)
            yield token
        finished = finished or text.full
        # a peer of this session convicted of computing wrong: correct the text without it
        if auditor is not None:
            if finished:
                await auditor.settle()  # a verdict on this request's steps still corrects it
            convicted = [p for p in auditor.take_convicted() if p in sess.served_by()]
            if convicted:
                fixed, row = await _correct_without(convicted, sess, steps, pipe, text, params, rng)
                todo, rows = [fixed], [row]
                continue
        if finished:
            if text.retracted:  # the corrected text ends where the retraction starts
                yield Token(None, "", text.retracted)
            return
        # draft -> send chunks -> receive the oldest -> accept
        if todo:  # the accepted text changed: drafts continue from it
            pipe.continue_from(text.out)
        await pipe.draft_and_send()
        chunk, logits = await pipe.receive()
        todo = pipe.accept(chunk, logits)
        rows = [logits[i] for i in pipe.rows[:len(todo)]]  # the rows the accepted tokens were chosen at


class _Steps:
    """One step through the session: hidden states out, the logits of its last positions back."""

    def __init__(self, sess: InferenceSession, model: LocalModel, logits_on_last: bool) -> None:
        self.sess, self.model, self.logits_on_last = sess, model, logits_on_last
        self.head = None if logits_on_last else head_batcher(model.head)

    async def send(self, tokens: list[int], *, pos: int, logits_for: int | None = None, epoch: int = 0,
                   tree: list[int] | None = None, keep: list[int] | None = None) -> int:
        hidden = self.model.head.embed(torch.tensor([tokens]))
        if logits_for is None:
            return await self.sess.send(hidden, pos=pos)
        if tree is None and keep is None:
            return await self.sess.send(hidden, pos=pos, logits_for=logits_for, epoch=epoch)
        return await self.sess.send(hidden, pos=pos, logits_for=logits_for, epoch=epoch, tree=tree, keep=keep)

    @property
    def trees(self) -> bool:
        """Whether the session's chain takes tree steps now."""
        return bool(getattr(self.sess, "trees", False))

    async def receive(self) -> tuple[int, torch.Tensor]:
        return await self.sess.receive()

    async def receive_step(self, n: int) -> torch.Tensor:
        """The result of step ``n``, which must be the next to come back."""
        got, result = await self.sess.receive()
        if got != n:
            raise InferenceError(ErrorCode.UNEXPECTED, f"expected result {n}, got {got}")
        return result

    async def logits(self, result: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """``[rows, vocab]``: the logits of a result's last ``rows`` positions (all: None). The
        last peer applied the head already, or the client applies it here (together with its
        other sessions' heads that are due at the same moment)."""
        if self.logits_on_last:
            return result[0].float() if rows is None else result[0, -rows:].float()
        return await self.head.logits(result if rows is None else result[:, -rows:])

    async def prefill(self, prompt: list[int]) -> torch.Tensor:
        """The prompt through the chain: its result (the last position's says the first new token)."""
        return await self.receive_step(await self.send(prompt, pos=0))


class _Text:
    """The accepted output, and its emission as tokens with text."""

    def __init__(self, model: LocalModel, prompt: list[int], max_new: int, stop_at_eos: bool,
                 stats: GenerationStats) -> None:
        self.model, self.prompt, self.max_new, self.stop_at_eos, self.stats = model, prompt, max_new, stop_at_eos, stats
        self.out: list[int] = []
        self.retracted = 0  # tokens withdrawn, announced with the next token emitted
        self.t0 = time.perf_counter()

    @property
    def full(self) -> bool:
        return len(self.out) >= self.max_new

    def emit(self, tok: int) -> Token | None:
        """Append an accepted token and return it with its text, or None when generation ends."""
        if self.stop_at_eos and tok in self.model.eos_ids or self.full:
            return None
        out = self.out
        out.append(tok)
        self.stats.new_tokens += 1
        self.stats.decode_s = time.perf_counter() - self.t0
        # decode incrementally so multi-token characters come out whole
        text = self.model.decode(out)
        prev = self.model.decode(out[:-1]) if len(out) > 1 else ""
        token = Token(tok, text[len(prev):], self.retracted)
        self.retracted = 0
        return token

    def retract_from(self, m: int) -> None:
        """Withdraw the tokens from index ``m`` on."""
        gone = len(self.out) - m
        self.retracted += gone
        self.stats.new_tokens -= gone
        self.stats.retracted += gone
        log.warning("withdrawing %d token(s) computed with a convicted peer", gone)
        del self.out[m:]


class _Pipeline:
    """Verify chunks in flight. ``spec`` is the accepted text plus every draft in flight, so the
    next chunk drafts ahead as if earlier chunks were all accepted; a rejection ends the epoch,
    and results of steps below ``stale_below`` (chunks of an ended epoch) are skipped."""

    def __init__(self, steps: _Steps, prompt: list[int], params: SamplingParams, rng: Randomness,
                 drafter: Drafter | None, k: int, depth: int, max_new: int, stats: SpeculationStats, *,
                 tree: bool | TreeShaper = False) -> None:
        self.steps, self.prompt, self.params, self.rng = steps, prompt, params, rng
        self.drafter, self.k, self.depth, self.max_new, self.stats = drafter, k, depth, max_new, stats
        #: trees of drafts where they can be verified (see generate_on; not with penalties, which
        #: count the tokens before each position: a branch's row would need its own path's)
        self.tree = bool(tree) and depth == 1 and not (params.frequency_penalty or params.presence_penalty)
        # (sampling: a fixed shape, so that a seed fixes the output; see Client.generate)
        self.shaper = tree if isinstance(tree, TreeShaper) else TreeShaper(k, fixed=None if params.greedy else (k, k))
        #: the cached positions of the last tree's accepted path, for the next step to keep
        self.keep: list[int] | None = None
        #: the logits rows the last accepted tokens were chosen at (a chain's: 0, 1, ...)
        self.rows: list[int] = []
        self.vocab = steps.model.ckpt.config.vocab_size
        self.spec = list(prompt)
        self.inflight: deque[_Chunk] = deque()  # of the current epoch, oldest first
        self.epoch, self.stale_below = 0, 0
        #: indices in the output of tokens accepted from chunks that had drafts
        self.drafted_at: set[int] = set()

    def _drafts_tree(self) -> bool:
        """Whether the next chunk is a tree: trees wanted, the chain takes them, and the drafter
        drafts them now (``drafts_trees``: a draft model; an AutoDrafter while it is chosen)."""
        if not (self.tree and self.steps.trees):
            return False
        ask = getattr(self.drafter, "drafts_trees_for", None)
        return ask(self.params.greedy) if ask is not None else getattr(self.drafter, "drafts_trees", False)

    def _heals(self) -> int:
        return len(getattr(self.steps.sess, "heals", ()))

    def continue_from(self, out: list[int]) -> None:
        """The accepted text changed: drafting continues from it and the drafts still in flight."""
        self.spec = self.prompt + out + [d for c in self.inflight for d in c.drafts]

    def _draft(self, budget: int) -> tuple[list[int], torch.Tensor | None]:
        t_draft = time.perf_counter()
        q = None
        if self.drafter is None or budget <= 0:
            drafts = []
        elif self.params.greedy:
            drafts = self.drafter.propose(self.spec, budget)
        else:
            drafts, q = self.drafter.sample(self.spec, budget, self.params, self.rng, self.vocab)
        self.stats.draft_s += time.perf_counter() - t_draft
        return drafts, q

    async def draft_and_send(self) -> None:
        """Keep ``depth`` chunks in flight: each is the last text token and up to ``k`` drafts."""
        spec, inflight = self.spec, self.inflight
        if self._drafts_tree() and len(spec) - len(self.prompt) < self.max_new:
            return await self._send_tree()
        while len(inflight) < self.depth and len(spec) - len(self.prompt) < self.max_new:
            drafts, q = self._draft(min(self.k, self.max_new - (len(spec) - len(self.prompt))))
            if not drafts and inflight:
                break  # nothing to speculate on: wait for a result first
            feed = [spec[-1]] + drafts
            by = getattr(self.drafter, "chosen", None)
            keep, self.keep = self.keep, None
            n = await self.steps.send(feed, pos=len(spec) - 1, logits_for=len(feed), epoch=self.epoch, keep=keep)
            inflight.append(_Chunk(n, self.epoch, len(spec), drafts, q, time.perf_counter(), by, heals=self._heals()))
            spec += drafts
            self.stats.chunks += 1
            if not drafts:
                break

    async def _send_tree(self) -> None:
        """One chunk: the last text token as the root of a tree of drafts."""
        spec = self.spec
        t_draft = time.perf_counter()
        k, branches = self.shaper.shape(self.stats)
        k = min(k, self.max_new - (len(spec) - len(self.prompt)), MAX_TREE_TOKENS - 1)
        branches = max(0, min(branches, k, MAX_TREE_TOKENS - 1 - k))
        q = None
        if k <= 0:
            drafts, parents = [], []
        elif self.params.greedy:
            drafts, parents = self.drafter.propose_tree(spec, k, branches)
        else:
            drafts, parents, q = self.drafter.sample_tree(spec, k, branches, self.params, self.rng, self.vocab)
        t_feed = time.perf_counter()
        self.stats.draft_s += t_feed - t_draft
        self.shaper.drafting(k, t_feed - t_draft)
        feed = [spec[-1]] + drafts
        keep, self.keep = self.keep, None
        n = await self.steps.send(feed, pos=len(spec) - 1, logits_for=len(feed), epoch=self.epoch,
                                  tree=[-1] + [p + 1 for p in parents] if drafts else None, keep=keep)
        sent = time.perf_counter()
        self.inflight.append(_Chunk(n, self.epoch, len(spec), drafts, q, sent, getattr(self.drafter, "chosen", None),
                                    parents if drafts else None, heals=self._heals(), send_s=sent - t_feed))
        self.stats.chunks += 1
        self.stats.trees += bool(drafts)
        if drafts:
            chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
            self.stats.shapes[(chain, len(parents) - chain)] += 1

    async def receive(self) -> tuple[_Chunk, torch.Tensor]:
        """The oldest chunk in flight and its logits, skipping stale results the peers computed anyway."""
        t_wait = time.perf_counter()
        n, result = await self.steps.receive()
        while n < self.stale_below:
            n, result = await self.steps.receive()
        self.stats.wait_s += time.perf_counter() - t_wait
        chunk = self.inflight.popleft()
        if chunk.n != n:
            raise InferenceError(ErrorCode.UNEXPECTED, f"result {n} does not match step {chunk.n}")
        t_result = time.perf_counter()
        round_trip = t_result - chunk.sent
        self.stats.round_trip_s += round_trip
        if self.stats.on_round_trip is not None:
            self.stats.on_round_trip(round_trip, len(chunk.drafts) + 1)
        # (what the chunk's start follows: the accepted text and the drafts of the chunks before it)
        generated = self.spec[len(self.prompt):chunk.start]
        logits = adjusted(await self.steps.logits(result), self.params, generated, chunk.drafts)
        if self.tree and self._heals() == chunk.heals:
            # one chunk in flight: its trip is its own (a chain's too, for the line), with the
            # client's own work on it: embedding and sending it, the head over its rows
            own = chunk.send_s + time.perf_counter() - t_result
            self.shaper.trip(len(chunk.drafts) + 1, round_trip + own)
        return chunk, logits

    def accept(self, chunk: _Chunk, logits: torch.Tensor) -> list[int]:
        """The tokens a chunk's logits accept (its kept drafts and one more), less what the next
        chunk in flight verifies anyway."""
        params = self.params
        if chunk.parents is not None:  # a tree: its accepted path, kept by the next step
            if params.greedy:
                path, bonus = accept_greedy_tree(chunk.drafts, chunk.parents, logits.argmax(-1).tolist())
            else:
                p = torch.stack([probabilities(row, params) for row in logits])
                path, bonus = accept_sampled_tree(chunk.drafts, chunk.parents, chunk.q, p, self.rng, chunk.start)
            kept = [chunk.drafts[i] for i in path] + [bonus]
            self.rows = [0] + [1 + i for i in path]  # each kept token was chosen at its parent's row
            self.stats.branched += path != list(range(len(path)))
            _count_tree(self.stats, chunk.parents, path)
            root = chunk.start - 1  # (no path: the next step starts right after the root, no keep needed)
            self.keep = [root] + [root + 1 + i for i in path] if path else None
        elif params.greedy:
            kept = accept_greedy(chunk.drafts, logits.argmax(-1).tolist())
            self.rows = list(range(len(kept)))
        else:
            p = torch.stack([probabilities(row, params) for row in logits])
            kept = accept_sampled(chunk.drafts, chunk.q, p, self.rng, chunk.start)
            self.rows = list(range(len(kept)))
        stats = self.stats
        stats.verified += 1
        stats.drafted += len(chunk.drafts)
        stats.accepted += len(kept) - 1
        observe = getattr(self.drafter, "observe", None)
        if observe is not None:  # a drafter that chooses as it goes (auto_drafter.py)
            observe(len(kept), by=chunk.by, drafted=len(chunk.drafts))
        if chunk.drafts:  # (sampled: the tokens it kept were not all drawn by the target's own rule)
            first = chunk.start - len(self.prompt)
            self.drafted_at.update(range(first, first + len(kept)))
        if len(kept) == len(chunk.drafts) + 1 and self.inflight:
            # all accepted: the next chunk in flight verifies what follows, bonus included
            todo = kept[:-1]
            stats.carried += 1
        else:
            todo = kept
            if self.inflight:
                # everything in flight drafted past a rejection: fence it off. The client forgets
                # those chunks now, so what it does next never depends on whether the peers
                # computed them or dropped them (which is timing): a seed fixes the output.
                stats.stale += len(self.inflight)
                self.new_epoch(stale_below=self.inflight[-1].n + 1)
        stats.tokens += len(todo)
        return todo

    def new_epoch(self, *, stale_below: int | None = None) -> None:
        """Forget every chunk in flight; their results, if they come, are stale (and a tree's
        path not kept yet: the caller re-sends the text, as after a correction)."""
        self.keep = None
        self.epoch += 1
        if stale_below is not None:
            self.stale_below = stale_below
        self.inflight.clear()


def _count_tree(stats: SpeculationStats, parents: list[int], path: list[int]) -> None:
    """What a verified tree says of its drafter's alpha and beta (``throughput.tree_tokens``): its
    chain is the run of drafts each the child of the one before, from the first; a branch is a
    draft beside one of the chain's (the same parent)."""
    chain = 0
    while chain < len(parents) and parents[chain] == chain - 1:
        chain += 1
    on_chain = 0
    while on_chain < len(path) and on_chain < chain and path[on_chain] == on_chain:
        on_chain += 1
    stats.chain_tried += min(on_chain + 1, chain)
    stats.chain_kept += on_chain
    if on_chain < chain and any(parents[i] == on_chain - 1 for i in range(chain, len(parents))):
        stats.branch_tried += 1
        stats.branch_kept += len(path) > on_chain


async def _correct_without(convicted: list[str], sess: InferenceSession, steps: _Steps, pipe: _Pipeline,
                           text: _Text, params: SamplingParams, rng: Randomness) -> tuple[int, torch.Tensor]:
    """The convicted peers' work is not trusted: move to a chain without them and send the whole
    text through it once, to learn which of our tokens stand. Retracts the first token the trusted
    logits do not support and what follows it; returns the token that belongs in its place, and
    the logits it was chosen from."""
    prompt, out = text.prompt, text.out
    await sess.exclude(convicted)
    pipe.new_epoch()
    n = await steps.send(prompt + out, pos=0, logits_for=len(out) + 1, epoch=pipe.epoch)
    pipe.stale_below = n
    rows = adjusted(await steps.logits(await steps.receive_step(n), rows=len(out) + 1), params, [], out)
    m, fixed = _first_wrong(out, rows, params, rng, len(prompt), pipe.drafted_at)
    if m < len(out):
        text.retract_from(m)
    pipe.drafted_at = {i for i in pipe.drafted_at if i < m}
    pipe.spec = prompt + out
    return fixed, rows[m]
