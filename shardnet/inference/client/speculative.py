"""Drafters for speculative decoding, and verification of their proposals.

One chain traversal verifies k drafted tokens at once: the client sends the last accepted token
plus the k drafts and the chain returns the target model's output for all k + 1 positions.
Peers roll their KV caches back to the accepted length on the next step (its position is lower
than what they hold).

- Greedy: the longest prefix of drafts the target agrees with is kept, plus the target's own
  next token (the bonus): output identical to plain greedy decoding.
- Sampling (temperature / top-k / top-p), lossless: draft token x, drawn from the draft's
  distribution q, is kept with probability min(1, p(x) / q(x)) where p is the target's
  distribution; at the first rejection the token is drawn from normalize(max(0, p - q)) instead;
  if every draft is kept, the bonus is drawn from p. Each emitted token is then distributed
  exactly as if sampled from p alone (Leviathan et al., Chen et al., 2023).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from shardnet.inference.client.sampling import (
    Randomness,
    SamplingParams,
    draw,
    probabilities,
)
from shardnet.inference.model.static_decoder import StaticKVDecoder


class Drafter(Protocol):
    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` greedy guesses of the tokens that follow ``ids``."""

    def sample(self, ids: list[int], k: int, params: SamplingParams, rng: Randomness,
               vocab_size: int) -> tuple[list[int], torch.Tensor]:
        """Up to ``k`` drafted tokens, each drawn from the drafter's distribution with
        ``rng.uniform(position, "draft")``, and those distributions ([len(tokens), vocab_size]
        float32) for verification."""


class NGramDrafter:
    """Model-free prompt lookup: continue with what followed the latest earlier occurrence of
    the text's last n tokens (longest n first)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, ids: list[int], k: int) -> list[int]:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ids) <= n:
                continue
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == tail:
                    cont = ids[start + n:start + n + k]
                    if cont:
                        return cont
        return []

    def sample(self, ids: list[int], k: int, params: SamplingParams, rng: Randomness,
               vocab_size: int) -> tuple[list[int], torch.Tensor]:
        return point_masses(self.propose(ids, k), vocab_size)


def point_masses(proposed: list[int], vocab_size: int) -> tuple[list[int], torch.Tensor]:
    """A deterministic drafter's proposal as ``Drafter.sample`` returns it: the tokens up to the
    first one outside the vocabulary (a chain: cut, not skipped), each drawn from a point mass
    (lossless: a draft the target would not draw is rejected and the target's residual drawn)."""
    tokens = list(itertools.takewhile(lambda t: t < vocab_size, proposed))
    q = torch.zeros(len(tokens), vocab_size)
    if tokens:
        q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return tokens, q


class ModelDrafter:
    """A small local model (the shipped tiny-llama-draft, for instance) run over a static KV
    cache (see static_decoder), captured in a CUDA graph on a GPU. Its cache follows the
    accepted text: each call keeps the longest prefix it shares with the new text and feeds the
    rest, so rejected drafts cost a rollback, not a recomputation."""

    name = "draft"
    #: greedy decoding verifies its trees where the chain takes them (``propose_tree``)
    drafts_trees = True

    def __init__(self, path: str | Path, *, vocab_size: int | None = None, device: str = "cpu",
                 max_len: int = 4096, cuda_graph: bool | None = None) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
        if vocab_size is not None and model.config.vocab_size != vocab_size:
            raise ValueError(f"draft vocabulary ({model.config.vocab_size}) differs from the "
                             f"target's ({vocab_size}); drafts would be meaningless")
        self.decoder = StaticKVDecoder(model, max_len, cuda_graph=cuda_graph)
        self.fed: list[int] = []  # the tokens the decoder's cache holds

    @property
    def graphed(self) -> bool:
        return self.decoder.graph is not None

    def forget(self) -> None:
        """Start the next text afresh (its cache is then filled the same way whatever came
        before: sampled drafts of one seed do not depend on an earlier generation)."""
        self.fed = []
        self.decoder.rollback(0)

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int) -> list[int]:
        if k <= 0 or len(ids) + k > self.decoder.max_len:
            return []  # past the draft's cache: decode on without speculation
        logits = self.decoder.feed(self._align(ids))
        drafts = [logits.argmax()]
        for _ in range(k - 1):
            drafts.append(self.decoder.step(drafts[-1]).argmax())
        tokens = torch.stack(drafts).tolist()  # one device sync for the whole chunk
        self.fed += tokens[:-1]
        return tokens

    @torch.inference_mode()
    def sample(self, ids: list[int], k: int, params: SamplingParams, rng: Randomness,
               vocab_size: int) -> tuple[list[int], torch.Tensor]:
        if k <= 0 or len(ids) + k > self.decoder.max_len:
            return [], torch.zeros(0, vocab_size)
        logits = self.decoder.feed(self._align(ids))
        tokens, qs = [], []
        for j in range(k):
            if j:
                self.fed.append(tokens[-1])
                logits = self.decoder.step(torch.tensor(tokens[-1], device=self.decoder.device))
            q = probabilities(logits[:vocab_size].float().cpu(), params)
            tokens.append(draw(q, rng.uniform(len(ids) + j, "draft")))
            qs.append(q)
        return tokens, torch.stack(qs)

    @torch.inference_mode()
    def sample_tree(self, ids: list[int], k: int, branches: int, params: SamplingParams, rng: Randomness,
                    vocab_size: int) -> tuple[list[int], list[int], torch.Tensor]:
        """``sample``'s chain of ``k`` and, beside its first ``branches`` drafts, a second draw from
        the same distribution (``rng.uniform(position, "draft-1")``, independent of the first, as
        ``accept_sampled_tree`` needs): tokens, parents (the chain first) and each draft's
        distribution."""
        tokens, q = self.sample(ids, k, params, rng, vocab_size)
        parents = list(range(-1, len(tokens) - 1))
        second = [draw(q[d], rng.uniform(len(ids) + d, "draft-1")) for d in range(min(branches, len(tokens)))]
        return tokens + second, parents + [d - 1 for d in range(len(second))], torch.cat([q, q[:len(second)]])

    @torch.inference_mode()
    def propose_tree(self, ids: list[int], k: int, branches: int | None = None,
                     width: int = 2) -> tuple[list[int], list[int]]:
        """The draft's greedy chain of ``k`` tokens and, as leaves beside it, up to ``branches``
        (default ``k``) of its other choices (the ``width`` - 1 likeliest after its greedy one
        at each depth): tokens and parent indices (-1: the text; parents before children), the
        chain first. The branches kept are the likeliest by the draft's own estimate (its
        probabilities along the path), so a tree costs the draft what the chain costs (k
        forward passes) and catches a miss where the draft's second choice is the target's.
        Teacher-forced over wan_decode's prompts (``bench/draft_agreement.py``) a chain of 6
        with 6 leaves yields 4.39 tokens per traversal where the chain alone yields 3.73."""
        if k <= 0 or len(ids) + k > self.decoder.max_len:
            return [], []
        branches = k if branches is None else branches
        chain: list[int] = []
        others: list[tuple[float, int, int]] = []  # (-estimate, depth, token)
        sure = 1.0  # the draft's probability of its chain so far
        logits = self.decoder.feed(self._align(ids))
        for depth in range(k):
            top = torch.topk(torch.softmax(logits.float(), dim=-1), width)
            p, t = top.values.tolist(), top.indices.tolist()
            chain.append(t[0])
            others += [(-sure * q, depth, u) for q, u in zip(p[1:], t[1:], strict=True)]
            sure *= p[0]
            if depth < k - 1:  # (as propose: one step on from the aligned cache, no re-alignment)
                logits = self.decoder.step(torch.tensor(t[0], device=self.decoder.device))
        self.fed += chain[:-1]
        tokens, parents = list(chain), list(range(-1, k - 1))
        for _, depth, token in sorted(heapq.nsmallest(branches, others), key=lambda o: o[1]):
            tokens.append(token)
            parents.append(depth - 1)
        return tokens, parents

    def _align(self, ids: list[int]) -> list[int]:
        """Roll the cache back to the longest prefix it shares with ``ids`` (keeping at least one
        token to feed); return the tokens still to feed."""
        common = 0
        for a, b in zip(self.fed, ids, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        self.decoder.rollback(common)
        self.fed = ids[:]
        return ids[common:]


@dataclass
class SpeculationStats:
    """What the verify chunks of one generation did. A chunk either ends a *cycle* (something
    was rejected, or nothing was in flight behind it: the next chunk starts one ring traversal
    later) or is *carried* (fully accepted with the next chunk already in flight)."""

    chunks: int = 0  # verify chunks sent
    verified: int = 0  # chunks whose result was used
    stale: int = 0  # chunks discarded after a rejection ahead of them
    carried: int = 0
    drafted: int = 0  # drafts in verified chunks
    accepted: int = 0
    tokens: int = 0  # tokens the verified chunks yielded
    trees: int = 0  # chunks sent as trees of drafts
    branched: int = 0  # trees whose accepted path left the draft's chain for one of its branches
    #: in the trees: drafts of the chain verified (reached) and accepted; second choices verified
    #: where the chain's draft beside them was rejected, and accepted (throughput.tree_tokens)
    chain_tried: int = 0
    chain_kept: int = 0
    branch_tried: int = 0
    branch_kept: int = 0
    draft_s: float = 0.0  # time spent drafting
    wait_s: float = 0.0  # time spent waiting for results
    round_trip_s: float = 0.0  # summed send-to-result time of verified chunks
    #: trees sent of each shape: (drafts in the chain, branches beside it) -> count
    shapes: Counter = field(default_factory=Counter, repr=False, compare=False)
    #: told each verified chunk's send-to-result time and how many tokens it carried (a monitor's
    #: histogram; the client's observed peer speeds)
    on_round_trip: Callable[[float, int], None] | None = field(default=None, repr=False, compare=False)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tree_rates(self) -> tuple[float, float]:
        """The trees' alpha (a chain draft accepted once reached) and beta (a second choice right
        where the chain's draft beside it was wrong), as measured; 0 where nothing was tried."""
        return (self.chain_kept / self.chain_tried if self.chain_tried else 0.0,
                self.branch_kept / self.branch_tried if self.branch_tried else 0.0)

    @property
    def cycles(self) -> int:
        return self.verified - self.carried

    @property
    def tokens_per_traversal(self) -> float:
        """Tokens gained per verified chunk."""
        return self.tokens / self.verified if self.verified else 0.0


def accept_greedy_tree(tokens: list[int], parents: list[int], target_tokens: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance of a tree of drafts (``tokens[i]``'s parent is ``parents[i]``, -1: the
    text): the indices of the longest path the target agrees with, root first, and the target's
    token after it. ``target_tokens[0]`` is the target's choice after the text, and
    ``target_tokens[i + 1]`` after draft i. Of two children with the same token (a drafter
    should not make them) the first is taken."""
    path: list[int] = []
    at = -1
    while True:
        want = target_tokens[at + 1]
        nxt = next((i for i, p in enumerate(parents) if p == at and tokens[i] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        at = nxt


def accept_sampled_tree(tokens: list[int], parents: list[int], q: torch.Tensor, p: torch.Tensor,
                        rng: Randomness, start: int) -> tuple[list[int], int]:
    """Lossless speculative sampling over a tree of drafts whose children of one node were drawn
    independently from one distribution (``q[i]``: draft i's; SpecInfer's multi-round
    speculative sampling): at each node its children are tried in order, each kept with
    probability min(1, r/q) where r starts as the target's distribution ``p[at + 1]`` (row 0:
    after the text, row i + 1: after draft i) and becomes the normalised residual max(r - q, 0)
    after each rejection; a kept child is the next node, and where every child is rejected the
    token is drawn from the last residual. So each token has exactly the target's distribution.
    Returns the kept path's indices and the token after it; a chain (one child per node) gives
    ``accept_sampled``'s tokens for the same numbers."""
    path: list[int] = []
    at = -1
    while True:
        position = start + len(path)
        dist = p[at + 1]
        children = [i for i, parent in enumerate(parents) if parent == at]
        for j, i in enumerate(children):
            x = tokens[i]
            if rng.uniform(position, "accept" if j == 0 else f"accept-{j}") * float(q[i, x]) < float(dist[x]):
                path.append(i)
                at = i
                break
            residual = (dist - q[i]).clamp_min(0.0)
            total = float(residual.sum())
            dist = residual / total if total > 0 else dist
        else:
            return path, draw(dist, rng.uniform(position, "residual" if children else "target"))


def accept_greedy(drafts: list[int], target_tokens: list[int]) -> list[int]:
    """Tokens to keep: the longest prefix of ``drafts`` the target agrees with, plus the target's
    token after it. ``target_tokens[i]`` is the target's choice after the i-th fed position."""
    i = 0
    while i < len(drafts) and drafts[i] == target_tokens[i]:
        i += 1
    return drafts[:i] + [target_tokens[i]]


def accept_sampled(drafts: list[int], q: torch.Tensor, p: torch.Tensor, rng: Randomness,
                   start: int) -> list[int]:
    """Lossless speculative sampling. ``q[i]``: the distribution drafts[i] was drawn from;
    ``p[i]``: the target's distribution at the same position (``p`` has one more row, for the
    bonus token after the last draft); ``start``: the position of drafts[0] in the text."""
    for i, x in enumerate(drafts):
        r = rng.uniform(start + i, "accept")
        if r * float(q[i, x]) < float(p[i, x]):  # kept with probability min(1, p/q)
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        dist = residual if float(residual.sum()) > 0 else p[i]
        return drafts[:i] + [draw(dist, rng.uniform(start + i, "residual"))]
    return drafts + [draw(p[len(drafts)], rng.uniform(start + len(drafts), "target"))]
