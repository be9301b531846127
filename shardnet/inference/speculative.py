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

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


class Drafter(Protocol):
    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` greedy guesses of the tokens that follow ``ids``."""

    def sample(self, ids: list[int], k: int, params, generator: torch.Generator | None,
               vocab_size: int) -> tuple[list[int], torch.Tensor]:
        """Up to ``k`` drafted tokens, each drawn from the drafter's distribution, and those
        distributions ([len(tokens), vocab_size] float32) for verification."""


class NGramDrafter:
    """Model-free prompt lookup: continue with what followed the latest earlier occurrence of
    the text's last n tokens (longest n first)."""

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

    def sample(self, ids: list[int], k: int, params, generator: torch.Generator | None,
               vocab_size: int) -> tuple[list[int], torch.Tensor]:
        # A lookup is deterministic: its distribution is a point mass on each proposed token.
        tokens = [t for t in self.propose(ids, k) if t < vocab_size]
        q = torch.zeros(len(tokens), vocab_size)
        if tokens:
            q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return tokens, q


class ModelDrafter:
    """A small local model proposing greedily (the shipped tiny-llama-draft, for instance). It
    keeps its own KV cache in step with the accepted text, cutting it back after rejections."""

    def __init__(self, path: str | Path, *, vocab_size: int | None = None, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
        if vocab_size is not None and self.model.config.vocab_size != vocab_size:
            raise ValueError(f"draft vocabulary ({self.model.config.vocab_size}) differs from the "
                             f"target's ({vocab_size}); drafts would be meaningless")
        self.device = device
        self.cache = None
        self.fed: list[int] = []  # the tokens self.cache holds

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        return self._run(self._align(ids), k, lambda logits: (int(logits.argmax()), None))[0]

    @torch.inference_mode()
    def sample(self, ids: list[int], k: int, params, generator: torch.Generator | None,
               vocab_size: int) -> tuple[list[int], torch.Tensor]:
        from .sampling import probabilities

        if k <= 0:
            return [], torch.zeros(0, vocab_size)

        def pick(logits: torch.Tensor) -> tuple[int, torch.Tensor]:
            q = probabilities(logits[:vocab_size], params)
            return int(torch.multinomial(q, 1, generator=generator)), q

        tokens, qs = self._run(self._align(ids), k, pick)
        return tokens, torch.stack(qs)

    def _align(self, ids: list[int]) -> list[int]:
        """Cut the cache back to the longest prefix it shares with ``ids`` (keeping at least one
        token to feed); return the tokens still to feed."""
        common = 0
        for a, b in zip(self.fed, ids, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        if self.cache is not None and common < len(self.fed):
            self.cache.crop(common - len(self.fed))
        self.fed = self.fed[:common]
        return ids[common:]

    def _run(self, feed: list[int], k: int, pick) -> tuple[list[int], list]:
        out, dists = [], []
        for _ in range(k):
            res = self.model(torch.tensor([feed], device=self.device), cache=self.cache, use_cache=True)
            self.cache = res.cache
            self.fed += feed
            tok, dist = pick(res.logits[0, -1].float())
            out.append(tok)
            dists.append(dist)
            feed = [tok]
        return out, dists


@dataclass
class SpeculationStats:
    traversals: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_traversal(self) -> float:
        return (self.accepted + self.traversals) / self.traversals if self.traversals else 0.0


def accept_greedy(drafts: list[int], target_tokens: list[int]) -> list[int]:
    """Tokens to keep: the longest prefix of ``drafts`` the target agrees with, plus the target's
    token after it. ``target_tokens[i]`` is the target's choice after the i-th fed position."""
    i = 0
    while i < len(drafts) and drafts[i] == target_tokens[i]:
        i += 1
    return drafts[:i] + [target_tokens[i]]


def accept_sampled(drafts: list[int], q: torch.Tensor, p: torch.Tensor,
                   generator: torch.Generator | None) -> list[int]:
    """Lossless speculative sampling. ``q[i]``: the distribution drafts[i] was drawn from;
    ``p[i]``: the target's distribution at the same position (``p`` has one more row, for the
    bonus token after the last draft)."""
    for i, x in enumerate(drafts):
        r = float(torch.rand((), generator=generator))
        if r * float(q[i, x]) <= float(p[i, x]):  # kept with probability min(1, p/q)
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return drafts[:i] + [int(torch.multinomial(dist, 1, generator=generator))]
    return drafts + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]
