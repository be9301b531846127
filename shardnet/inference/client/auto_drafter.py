"""``--speculate auto``: speculation that decides as it goes whether it helps, and with which drafter.

Speculation pays when a traversal's cost is mostly waiting (round trips over a WAN) and drafts
are often right; on a fast local chain a chunk of k + 1 positions costs the peers more compute
than one token, and drafts that are mostly rejected make decoding slower than plain. Which side
of that line a run is on depends on the swarm and the text, so ``AutoDrafter`` measures it: it
tries each of its candidates (a draft model when there is one, the suffix drafter, and plain
decoding: no drafts) for a few verify chunks (``PROBE_CHUNKS`` with drafts each: a suffix drafter
without a match yet sends plain steps, which tell nothing of it), keeps the one that yielded the
most so far in the generation for ``EXPLOIT_CHUNKS`` chunks (a quarter of that for plain
decoding), then tries the others again, since a text changes character as it grows (output
repeats itself, a code block starts) and each trial adds to what the choice rests on.

What "yields the most" means depends on the sampling:

- Greedy: tokens per second of wall time while each candidate drafted (drafting, the chain's
  traversals and verification all included). The output is identical whatever is chosen.
- Sampling: tokens per verify chunk (the accepted drafts plus one), and plain decoding unless a
  drafter yields at least ``MIN_SAMPLED_GAIN`` tokens per chunk (plain decoding yields one a
  chunk: it is not tried, its figure is known). These counts depend only on the text, the drafts
  and the seed, never on timing, so a seed still fixes the output (lossless speculative sampling
  keeps its distribution whichever drafter drafts).

A greedy generation may start from an earlier one's figures (``start_from``: a client passes its
previous greedy generation's over the same candidates), skipping the first round of trials,
which cost a short generation most (a quarter of the draft model's rate over 64-token outputs,
docs/benchmarks.md).

Which of the two a run is, the decode loop says by what it calls: ``propose`` (greedy) or
``sample``. It tells the drafter what each verified chunk yielded through ``observe``, naming the
candidate that drafted it (with chunks in flight, a chunk drafted before a switch is credited to
the candidate that drafted it; decode.py). Drafters without ``observe`` are used as they are.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from shardnet.inference.client.sampling import Randomness, SamplingParams

#: Verify chunks each candidate drafts when tried.
PROBE_CHUNKS = 3
#: Verify chunks the chosen candidate drafts before the others are tried again.
EXPLOIT_CHUNKS = 64
#: A trial ends after this many times ``PROBE_CHUNKS`` chunks in which the drafter proposed nothing
#: (a suffix drafter without a match yet), if its chunks with drafts have not ended it before.
EMPTY_TRIAL_FACTOR = 2
#: With sampling, a drafter is used only if it yields at least this many tokens per chunk (plain
#: decoding yields 1; a chunk of k + 1 positions costs the peers more than one of 1).
MIN_SAMPLED_GAIN = 1.3
PLAIN = "plain"

log = logging.getLogger(__name__)


@dataclass
class CandidateStats:
    """What one candidate's verify chunks yielded in this generation (chunks without drafts of a
    drafter left out: they are plain decoding steps)."""

    chunks: int = 0
    tokens: float = 0
    seconds: float = 0.0

    @property
    def tokens_per_chunk(self) -> float:
        return self.tokens / self.chunks if self.chunks else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class AutoDrafter:
    """A drafter that switches between ``candidates`` (name -> drafter; ``None``: no drafts,
    plain decoding) by what each yields, as the module says. The first candidate is tried first;
    a run's choices are in ``choices`` (name, chunk at which it was chosen). One per generation."""

    name = "auto"

    def __init__(self, candidates: dict[str, object | None], *,
                 probe_chunks: int = PROBE_CHUNKS, exploit_chunks: int = EXPLOIT_CHUNKS) -> None:
        if not candidates:
            raise ValueError("AutoDrafter needs at least one candidate")
        self.candidates = dict(candidates)
        #: greedy (propose called) or sampling (sample called); None until the first draft
        self.greedy: bool | None = None
        self.probe_chunks, self.exploit_chunks = probe_chunks, exploit_chunks
        self.stats = {name: CandidateStats() for name in self.candidates}
        self._order = list(self.candidates)  # the trial order of the current round
        self._trial = 0  # index into _order while trying; len(_order) once a choice is made
        self.current = self._order[0]
        self._left = probe_chunks  # chunks before the next decision
        self._empty = 0  # chunks without drafts from the current drafter since it was chosen
        self._since: float | None = None  # when the latest chunk (or the first draft) was observed
        self.chunks = 0
        self.choices: list[tuple[str, int]] = [(self.current, 0)]
        #: an earlier generation's AutoDrafter to start from (``start_from``)
        self.prior: AutoDrafter | None = None

    def start_from(self, previous: AutoDrafter) -> None:
        """Begin where ``previous`` (an earlier generation's, over the same candidates) left off,
        if both decode greedily: its figures, at half weight (a new text may differ), choose
        the first candidate, and the first round of trials is skipped; the others are tried
        again when the choice has run its course, as always. Sampled generations start afresh
        (their choices must depend on their own text and seed alone: a seed fixes the output)."""
        if previous.candidates.keys() == self.candidates.keys() and previous.greedy and previous.chunks:
            self.prior = previous

    @property
    def chosen(self) -> str:
        """The candidate drafting now."""
        return self.current

    @property
    def drafter(self):
        return self.candidates[self.current]

    def describe(self) -> str:
        """One line for a user: which drafters it chooses between and what each yielded."""
        parts = []
        for name, st in self.stats.items():
            if st.chunks:
                rate = f"{st.tokens / st.seconds:.1f} tok/s" if self.greedy and st.seconds > 0 else \
                    f"{st.tokens / st.chunks:.2f} tokens/chunk"
                parts.append(f"{name} {st.chunks} chunks, {rate}")
            else:
                parts.append(f"{name} unused")
        return f"auto ({'; '.join(parts)}); drafting with {self.current} last"

    # the Drafter protocol ------------------------------------------------------------------
    def propose(self, ids: list[int], k: int) -> list[int]:
        self._begin(greedy=True)
        d = self.drafter
        return [] if d is None else d.propose(ids, k)

    @property
    def drafts_trees(self) -> bool:
        """Whether the candidate that drafts next drafts trees (``propose_tree``: a draft model),
        asked by greedy decoding (``drafts_trees_for``)."""
        return self.drafts_trees_for(greedy=True)

    def drafts_trees_for(self, greedy: bool) -> bool:
        """Whether the candidate that drafts next drafts trees (``propose_tree``, ``sample_tree``:
        a draft model). Asked before drafting: the first ask settles the mode, greedy or
        sampling (and may choose a candidate from an earlier generation's figures)."""
        self._begin(greedy=greedy)
        return getattr(self.drafter, "drafts_trees", False)

    def propose_tree(self, ids: list[int], k: int, branches: int | None = None) -> tuple[list[int], list[int]]:
        if self.drafts_trees_for(greedy=True):
            return self.drafter.propose_tree(ids, k, branches)
        chain = self.propose(ids, k)  # (a candidate of chains: a chain, as a tree)
        return chain, list(range(-1, len(chain) - 1))

    def sample_tree(self, ids: list[int], k: int, branches: int, params: SamplingParams, rng: Randomness,
                    vocab_size: int) -> tuple[list[int], list[int], torch.Tensor]:
        if self.drafts_trees_for(greedy=False):
            return self.drafter.sample_tree(ids, k, branches, params, rng, vocab_size)
        tokens, q = self.sample(ids, k, params, rng, vocab_size)  # (a candidate of chains: a chain, as a tree)
        return tokens, list(range(-1, len(tokens) - 1)), q

    def sample(self, ids: list[int], k: int, params: SamplingParams, rng: Randomness,
               vocab_size: int) -> tuple[list[int], torch.Tensor]:
        self._begin(greedy=False)
        d = self.drafter
        if d is None:
            return [], torch.zeros(0, vocab_size)
        return d.sample(ids, k, params, rng, vocab_size)

    def observe(self, tokens: int, by: str | None = None, drafted: int | None = None) -> None:
        """A verified chunk yielded ``tokens`` (its accepted drafts and one more); ``by``: the
        candidate that drafted it (``chosen`` when it was drafted; default: the current one);
        ``drafted``: how many drafts it carried. A drafter's chunk without drafts (a suffix
        drafter that found no match) is a plain decoding step: it tells nothing about the
        drafter and does not count towards its trial."""
        now = time.perf_counter()
        name = by if by in self.stats else self.current
        st = self.stats[name]
        spent = now - self._since if self._since is not None else 0.0
        self._since = now
        if drafted == 0 and self.candidates[name] is not None:
            if name != self.current:
                return
            if self._trial < len(self._order):  # a trial waits this long at most for drafts
                self._empty += 1
                if self._empty >= EMPTY_TRIAL_FACTOR * self.probe_chunks:
                    self._decide()
            else:  # chosen: its turn is counted in chunks, drafts or not
                self._left -= 1
                if self._left <= 0:
                    self._decide()
            return
        st.chunks += 1
        st.tokens += tokens
        st.seconds += spent
        self.chunks += 1
        if name != self.current:  # drafted before the switch: the current trial's chunks are its own
            return
        self._left -= 1
        if self._left <= 0:
            self._decide()

    # ---------------------------------------------------------------------------------------
    def _begin(self, *, greedy: bool) -> None:
        if self.greedy is None:
            self.greedy = greedy
            if greedy and self.prior is not None:
                self._seed(self.prior)
            elif not greedy and self.candidates[self.current] is None:  # plain's figure is known
                self._decide()
        if self._since is None:
            self._since = time.perf_counter()

    def _seed(self, prior: AutoDrafter) -> None:
        for name, st in prior.stats.items():
            self.stats[name] = CandidateStats(-(-st.chunks // 2), st.tokens / 2, st.seconds / 2)
        self._trial = len(self._order)  # as if every candidate had been tried
        best = self.best()
        self._switch(best, self.exploit_chunks if self.candidates[best] is not None else self.exploit_chunks // 4)

    def _switch(self, name: str, chunks: int) -> None:
        if name != self.current:
            self.choices.append((name, self.chunks))
        self.current, self._left, self._empty = name, chunks, 0

    def _decide(self) -> None:
        while self._trial < len(self._order) - 1:  # the next candidate's trial
            self._trial += 1
            name = self._order[self._trial]
            if self.greedy is False and self.candidates[name] is None:
                continue  # sampling: plain decoding yields one token a chunk; nothing to learn
            self._switch(name, self.probe_chunks)
            return
        if self._trial == len(self._order) - 1:  # every candidate tried (or known): choose
            self._trial += 1
            best = self.best()
            # plain decoding chosen: the drafters are tried again sooner (a text gets repetitive)
            self._switch(best, self.exploit_chunks if self.candidates[best] is not None else self.exploit_chunks // 4)
            return
        # the chosen one ran its course: try the others again, the chosen one last (it goes on
        # without a gap if it is still the best)
        best = self.current
        self._order = [n for n in self.candidates if n != best] + [best]
        self._trial = -1
        self._decide()

    def best(self) -> str:
        """The candidate that yielded the most so far (see the module's docstring)."""
        tried = [n for n in self.candidates if self.stats[n].chunks]
        if not tried:  # (no drafter drafted anything: plain decoding, where it is a candidate)
            return next((n for n in self.candidates if self.candidates[n] is None), self.current)
        if self.greedy:
            return max(tried, key=lambda n: self.stats[n].tokens_per_s)
        drafting = [n for n in tried if self.candidates[n] is not None]
        top = max(drafting, key=lambda n: self.stats[n].tokens_per_chunk, default=None)
        if top is not None and self.stats[top].tokens_per_chunk >= MIN_SAMPLED_GAIN:
            return top
        plain = [n for n in self.candidates if self.candidates[n] is None]
        return plain[0] if plain else (top or self.current)


#: What ``--speculate`` accepts.
SPECULATE_CHOICES = ("auto", "none", "draft", "suffix", "ngram")


def drafter_for(speculate: str, *, vocab_size: int, draft_path=None, draft_model=None, suffix_cache=None):
    """The drafter ``--speculate`` names (None for "none"). "auto": an ``AutoDrafter`` over a draft
    model (``draft_model``, else loaded from ``draft_path``; none when neither is given or it cannot
    be loaded, which is logged), the suffix drafter and plain decoding; "draft" needs one. The
    suffix drafter also matches ``suffix_cache`` (a ``SuffixCache`` of earlier outputs), if given."""
    from shardnet.inference.client.speculative import ModelDrafter, NGramDrafter
    from shardnet.inference.client.suffix_drafter import SuffixDrafter

    if speculate == "none":
        return None
    if speculate == "ngram":
        return NGramDrafter()
    if speculate == "suffix":
        return SuffixDrafter(cache=suffix_cache)
    if speculate == "draft":
        if draft_model is None and draft_path is None:
            raise ValueError("speculation with a draft model needs one: none was given and the model's card names none")
        return draft_model or ModelDrafter(draft_path, vocab_size=vocab_size)
    if speculate == "auto":
        candidates: dict[str, object | None] = {}
        if draft_model is None and draft_path is not None:
            try:
                draft_model = ModelDrafter(draft_path, vocab_size=vocab_size)
            except Exception as e:  # a draft that cannot run here: speculate without it
                log.warning("the draft model at %s cannot be used (%s: %s); speculating without it", draft_path,
                            type(e).__name__, e)
        if draft_model is not None:
            candidates["draft"] = draft_model
        candidates["suffix"] = SuffixDrafter(cache=suffix_cache)
        candidates[PLAIN] = None
        return AutoDrafter(candidates)
    raise ValueError(f"--speculate {speculate!r}: one of {', '.join(SPECULATE_CHOICES)}")


async def find_draft(node, model, *, cache_dir=None, progress=None, required: bool = False):
    """Where the draft for ``model`` (a LocalModel) is: the shipped draft for the shipped model,
    else the one its model card names, fetched whole from the swarm (``fetch_draft``: checked
    like any weights). None when there is none, or, unless ``required``, when fetching it fails
    (logged: speculation goes on without it)."""
    from shardnet.inference.weights.swarm_model import fetch_draft
    from shardnet.models import shipped_draft_for

    shipped = shipped_draft_for(model.ckpt.path)
    if shipped is not None or node is None:
        return shipped
    try:
        return await fetch_draft(node, model.model_id, vocab_size=model.ckpt.config.vocab_size,
                                 model_bytes=model.ckpt.total_bytes, cache_root=cache_dir, progress=progress)
    except Exception as e:
        if required:
            raise
        log.warning("could not fetch the draft model its card names: %s; speculating without it", e)
        return None
