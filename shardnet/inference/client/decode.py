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
from shardnet.inference.client.healing import Heal
from shardnet.inference.client.sampling import (
    Randomness,
    SamplingParams,
    next_token,
    probabilities,
)
from shardnet.inference.client.speculative import (
    Drafter,
    SpeculationStats,
    accept_greedy,
    accept_sampled,
)
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
