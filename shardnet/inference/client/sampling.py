"""Choosing the next token from logits: greedy, or temperature / top-k / top-p with a seed;
OpenAI's frequency and presence penalties and logit bias adjust the logits first."""

from __future__ import annotations

import hashlib
import secrets
from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    #: OpenAI's: a token's logit falls by frequency_penalty for each time it was generated so far,
    #: and by presence_penalty once if it was; logit_bias adds (token, bias) to its logit
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted before choosing (penalties or a bias)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)

    def receipt_fields(self) -> dict:
        """What a run receipt records beyond temperature/top_p/top_k (only what is set, so a run
        without them has the receipt it always had)."""
        out: dict = {}
        if self.frequency_penalty:
            out["frequency_penalty"] = self.frequency_penalty
        if self.presence_penalty:
            out["presence_penalty"] = self.presence_penalty
        if self.logit_bias:
            out["logit_bias"] = [[t, b] for t, b in self.logit_bias]
        return out


def adjusted(logits: torch.Tensor, p: SamplingParams, generated: list[int], row_tokens: list[int]) -> torch.Tensor:
    """``logits`` [rows, vocab] with the penalties and bias applied (as given when nothing adjusts).
    Row 0 follows the ``generated`` tokens; row i follows them and ``row_tokens[:i]`` (the tokens
    the earlier rows verify: drafts, or the text being checked), as OpenAI defines the penalties:
    over the tokens generated before the position, not the prompt."""
    if not p.adjusts:
        return logits
    out = logits.float().clone()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias])
        out[:, ids] += torch.tensor([b for _, b in p.logit_bias])
    if p.frequency_penalty or p.presence_penalty:
        counts = Counter(generated)
        for i in range(out.shape[0]):
            if counts:
                ids = torch.tensor(list(counts))
                n = torch.tensor(list(counts.values()), dtype=torch.float32)
                out[i, ids] -= n * p.frequency_penalty + p.presence_penalty
            if i < len(row_tokens):
                counts[row_tokens[i]] += 1
    return out


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from (float32, sums to 1), after temperature/top-k/top-p."""
    logits = logits.float() / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Randomness:
    """Seeded uniform numbers keyed by (position, purpose) instead of drawn from one stream.

    With verify chunks in flight, how many drafts are made before a given result is read depends
    on timing (which stale chunks the peers dropped); a single generator would then give the
    same seed different outputs. Keyed numbers do not depend on the order they are asked for.
    They also keep speculative sampling lossless: the numbers used at position i are fresh for
    every decision made there, independent of everything that fixed the text before i.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed if seed is not None else secrets.randbits(63)

    def uniform(self, position: int, purpose: str) -> float:
        """A number in [0, 1)."""
        digest = hashlib.blake2b(f"{self.seed}:{position}:{purpose}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def draw(dist: torch.Tensor, u: float) -> int:
    """Inverse-CDF sampling: the token whose probability interval holds ``u`` (never one with
    zero probability). ``dist``: [vocab], non-negative, need not be normalised."""
    cdf = torch.cumsum(dist.double(), 0)
    return min(int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True)), dist.shape[0] - 1)


def next_token(logits: torch.Tensor, p: SamplingParams, rng: Randomness | None, position: int) -> int:
    """The token at ``position`` given the logits [vocab] before it."""
    if p.greedy:
        return int(torch.argmax(logits))
    return draw(probabilities(logits, p), rng.uniform(position, "target"))
