"""Whether served tokens are what the model computes, allowing for honest rounding.

Two honest computations of the same text need not give the same logits: float16 and bfloat16
round differently when steps are batched with other sessions' (continuous batching), when the
kernels or the summation order differ (another GPU), or when a prompt is computed in one pass
instead of step by step. A greedy token is then sometimes not the argmax of a recomputation: a
near-tie rounded the other way. So a served token is **consistent** with a recomputation when
its logit is within the tolerance of the best logit at its position:

    gap = (max(logits) - logits[token]) / max(|logits|)  <=  LOGIT_TOLERANCE[dtype]

(relative to the position's largest |logit|, like ``audit.divergence``, so the figure does not
depend on the model's logit scale). The **margin** is ``tolerance - gap``; the smallest margin of
a run, and where, is what ``shardnet verify --recompute`` reports.

The tolerances are measured, not guessed: ``python -m bench.logit_tolerance`` (docs/security.md
has the command and its figures) computes the shipped tiny-llama's steps batched as a compute peer
batches them and recomputes them teacher-forced in one pass, in each dtype, on a CPU.
Each tolerance is that largest relative logit difference, times 2 (the served token's logit and
the best one may each be off by it), times a margin for what was not measured (other hardware).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the largest relative gap a served token may fall below the recomputed best (see the docstring).
#: Measured on CPU (bench/logit_tolerance.py, 8 sessions x 24 tokens x 3 seeds): the largest
#: relative logit difference was 1.1e-6 in float32, 1.2e-3 in float16, 9.4e-3 in bfloat16; each
#: tolerance is 2x that times a margin of 4.7 (float32), 2.5 (float16), 2.4 (bfloat16). float16's
#: stays below 1e-2, so a token shifted into first place by 1 % is caught; in bfloat16 it is not.
#: int8q (activations sent as int8) is not measured: it counts as twice bfloat16.
LOGIT_TOLERANCE = {"float32": 1e-5, "float16": 6e-3, "bfloat16": 4.5e-2, "int8q": 9e-2}
#: what a dtype nobody recorded counts as (old receipts): the widest of the half precisions
UNKNOWN = "bfloat16"


def logit_tolerance(*names: str | None) -> float:
    """The widest tolerance of the dtypes involved (a run is as coarse as its coarsest part);
    a name not in the table (or None) counts as ``UNKNOWN``."""
    return max(LOGIT_TOLERANCE.get(n or "", LOGIT_TOLERANCE[UNKNOWN]) for n in names) if names else \
        LOGIT_TOLERANCE[UNKNOWN]


@dataclass
class TokenVerdict:
    """The check of every generated token against recomputed logits."""

    ok: bool
    tokens: int
    tolerance: float
    worst: int  # index (into the output) of the smallest margin; on failure, of the first token beyond
    gap: float  # the relative gap at ``worst``
    not_argmax: int  # tokens that are not the recomputed argmax (each within tolerance when ok)
    exact: bool = False  # compared exactly (tolerance 0 and the argmax required)
    beyond: int = 0  # tokens beyond the tolerance

    @property
    def margin(self) -> float:
        return self.tolerance - self.gap

    def describe(self) -> str:
        if not self.tokens:
            return "no tokens to check"
        if self.exact:
            return (f"{self.tokens} tokens recomputed locally: identical" if self.ok
                    else f"token {self.worst} is not the recomputed argmax ({self.not_argmax} of {self.tokens} differ)")
        if self.ok:
            return (f"{self.tokens} tokens recomputed teacher-forced: each within {self.tolerance:.1e} of the best "
                    f"logit ({self.not_argmax} not the argmax); smallest margin {self.margin:.2e} at token "
                    f"{self.worst} (gap {self.gap:.2e})")
        return (f"token {self.worst} is {self.gap:.2e} below the best logit, beyond the tolerance "
                f"{self.tolerance:.1e} (margin {self.margin:.2e}; {self.beyond} of {self.tokens} tokens beyond it)")


def gaps_to_best(logits: torch.Tensor) -> torch.Tensor:
    """Every token's gap in ``logits`` [..., vocab]: how far its logit is below its row's best,
    relative to the row's largest |logit| (the measure tolerances are stated in)."""
    logits = logits.float()
    return (logits.amax(-1, keepdim=True) - logits) / logits.abs().amax(-1, keepdim=True).clamp_min(1e-12)


def relative_gaps(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Per row of ``logits`` [n, vocab]: ``tokens[i]``'s gap to the row's best (``gaps_to_best``)."""
    index = torch.tensor(tokens, device=logits.device)[:, None]
    return gaps_to_best(logits).gather(-1, index)[:, 0].cpu()


def check_tokens(logits: torch.Tensor, tokens: list[int], tolerance: float, *, exact: bool = False) -> TokenVerdict:
    """Each ``tokens[i]`` against the logits of its position (row i of ``logits`` [n, vocab]):
    within ``tolerance`` of the best, or (``exact``) the argmax itself."""
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(tokens)} tokens")
    if not tokens:
        return TokenVerdict(True, 0, tolerance, 0, 0.0, 0, exact)
    gaps = relative_gaps(logits, tokens)
    not_argmax = gaps > 0
    if exact:
        first = int(not_argmax.nonzero()[0, 0]) if bool(not_argmax.any()) else 0
        return TokenVerdict(not bool(not_argmax.any()), len(tokens), 0.0, first, float(gaps[first]),
                            int(not_argmax.sum()), exact=True)
    beyond = gaps > tolerance
    # a failure names the first token beyond the tolerance (later ones follow a wrong text);
    # a pass, the smallest margin
    worst = int(beyond.nonzero()[0, 0]) if bool(beyond.any()) else int(gaps.argmax())
    return TokenVerdict(not bool(beyond.any()), len(tokens), tolerance, worst, float(gaps[worst]),
                        int(not_argmax.sum()), beyond=int(beyond.sum()))
