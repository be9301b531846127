"""Drafters for speculative decoding, and greedy verification of their proposals.

One chain traversal verifies k drafted tokens at once: the client sends the last accepted token
plus the k drafts, the chain returns the target model's output for all k + 1 positions, the
longest prefix of drafts that the target agrees with is accepted, plus the target's own next
token (the bonus). Peers roll their KV caches back to the accepted length on the next step (its
position is lower than what they hold). Greedy output is identical to plain greedy decoding
whatever the drafts are; good drafts just need fewer traversals.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


class Drafter(Protocol):
    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` guesses of the tokens that follow ``ids``."""


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
        common = 0
        for a, b in zip(self.fed, ids, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # always feed at least one token
        if self.cache is not None and common < len(self.fed):
            self.cache.crop(common - len(self.fed))
        self.fed = self.fed[:common]
        feed = ids[common:]
        out = []
        for _ in range(k):
            res = self.model(torch.tensor([feed], device=self.device), cache=self.cache, use_cache=True)
            self.cache = res.cache
            self.fed += feed
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            feed = [nxt]
        return out


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
