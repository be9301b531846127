"""``--speculate auto`` (client/auto_drafter.py): tries each candidate, keeps the one that yields
the most, tries the others again now and then; with sampling, decides on counts only."""

import pytest
import torch

from shardnet.inference.client import auto_drafter as ad
from shardnet.inference.client.auto_drafter import AutoDrafter, drafter_for
from shardnet.inference.client.sampling import Randomness, SamplingParams
from shardnet.inference.client.suffix_drafter import SuffixDrafter


class Fixed:
    """Proposes ``k`` copies of one token."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, ids, k):
        return [self.token] * k

    def sample(self, ids, k, params, rng, vocab_size):
        q = torch.zeros(k, vocab_size)
        q[:, self.token] = 1.0
        return [self.token] * k, q


def draft(auto: AutoDrafter, greedy: bool) -> list[int]:
    if greedy:
        return auto.propose([1, 2, 3], 4)
    return auto.sample([1, 2, 3], 4, SamplingParams(0.8), Randomness(1), 16)[0]


def run(auto: AutoDrafter, yields: dict[str, int], chunks: int, clock=None, greedy: bool = False) -> list[str]:
    """Drive ``auto`` as decode.py does: draft, then observe what the chosen candidate yields."""
    used = []
    for _ in range(chunks):
        drafts = draft(auto, greedy)
        name = auto.chosen
        assert (drafts == []) == (auto.candidates[name] is None)
        if clock is not None:
            clock(name)
        used.append(name)
        auto.observe(yields[name])
    return used


def test_sampled_choice_tries_each_then_keeps_the_best_and_tries_again():
    auto = AutoDrafter({"a": Fixed(5), "b": Fixed(6), "plain": None}, probe_chunks=2, exploit_chunks=5)
    used = run(auto, {"a": 2, "b": 4, "plain": 1}, 2 * 2 + 5 + 2 * 2)
    assert used[:4] == ["a", "a", "b", "b"]  # plain decoding is not tried: one token a chunk
    assert used[4:9] == ["b"] * 5  # the most tokens per chunk
    assert used[9:] == ["a", "a", "b", "b"]  # the others again, the chosen one last
    assert auto.chosen == "b" and auto.greedy is False
    assert [c for c, _ in auto.choices] == ["a", "b", "a", "b"]
    assert "b 9 chunks, 4.00 tokens/chunk" in auto.describe()


def test_a_chunk_drafted_before_a_switch_counts_for_its_drafter():
    auto = AutoDrafter({"a": Fixed(5), "b": Fixed(6)}, probe_chunks=2, exploit_chunks=5)
    draft(auto, False)
    auto.observe(2, by="a")
    auto.observe(2, by="a")  # a's trial ends: b's begins
    assert auto.chosen == "b"
    auto.observe(3, by="a")  # in flight when b took over: a's, and not one of b's two
    assert auto.stats["a"].chunks == 3 and auto.stats["b"].chunks == 0 and auto.chosen == "b"


def test_sampled_choice_is_plain_unless_a_drafter_gains_enough():
    # 7 tokens in 6 chunks (1.17 each) is below MIN_SAMPLED_GAIN: chunks of k + 1 positions are not worth it
    auto = AutoDrafter({"suffix": Fixed(5), "plain": None}, probe_chunks=6, exploit_chunks=16)
    yields = iter([1, 1, 2, 1, 1, 1] + [1] * 4)
    used = []
    for _ in range(10):
        draft(auto, False)
        used.append(auto.chosen)
        auto.observe(next(yields))
    assert auto.stats["suffix"].tokens_per_chunk < ad.MIN_SAMPLED_GAIN
    assert used[6:] == ["plain"] * 4


def test_greedy_choice_goes_by_tokens_per_second(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(ad.time, "perf_counter", lambda: now[0])
    cost = {"draft": 0.030, "suffix": 0.010, "plain": 0.004}  # seconds per chunk

    def clock(name):
        now[0] += cost[name]

    auto = AutoDrafter({"draft": Fixed(5), "suffix": Fixed(6), "plain": None}, probe_chunks=3, exploit_chunks=12)
    # the draft yields most per chunk (3) but slowly: 100 tok/s; suffix 2 per 10 ms: 200; plain 250
    used = run(auto, {"draft": 3, "suffix": 2, "plain": 1}, 9 + 3, clock, greedy=True)
    assert used[:9] == ["draft"] * 3 + ["suffix"] * 3 + ["plain"] * 3
    assert used[9:] == ["plain"] * 3
    assert auto.best() == "plain"
    assert "plain 6 chunks, 250.0 tok/s" in auto.describe()


def test_a_candidate_of_none_proposes_nothing_and_samples_nothing():
    auto = AutoDrafter({"plain": None})
    drafts, q = auto.sample([1, 2], 4, SamplingParams(0.8), Randomness(1), 16)
    assert drafts == [] and q.shape == (0, 16)


def test_drafter_for_names_each_choice(tmp_path, caplog):
    assert drafter_for("none", vocab_size=10) is None
    assert isinstance(drafter_for("suffix", vocab_size=10), SuffixDrafter)
    auto = drafter_for("auto", vocab_size=10)
    assert list(auto.candidates) == ["suffix", "plain"]  # no draft model given
    # a draft that cannot run here (no model at all, or another vocabulary): auto goes on without it
    auto = drafter_for("auto", vocab_size=10, draft_path=tmp_path)
    assert list(auto.candidates) == ["suffix", "plain"] and "cannot be used" in caplog.text
    with pytest.raises(ValueError, match="needs one"):
        drafter_for("draft", vocab_size=10)
    with pytest.raises(ValueError, match="one of auto"):
        drafter_for("beam", vocab_size=10)


def test_a_drafters_chunks_without_drafts_do_not_count_and_plain_is_left_sooner(monkeypatch):
    """A suffix drafter with no match yet sends plain steps: they say nothing of it, so its trial
    waits for chunks that carry drafts; plain decoding, once chosen, runs a quarter as long."""
    now = [0.0]
    monkeypatch.setattr(ad.time, "perf_counter", lambda: now[0])
    auto = AutoDrafter({"suffix": Fixed(5), "plain": None}, probe_chunks=2, exploit_chunks=8)

    def chunk(tokens, drafted, seconds):
        draft(auto, True)
        now[0] += seconds
        auto.observe(tokens, by=auto.chosen, drafted=drafted)

    for _ in range(3):
        chunk(1, 0, 0.010)
    assert auto.chosen == "suffix" and auto.stats["suffix"].chunks == 0
    chunk(1, 4, 0.020)
    chunk(1, 4, 0.020)  # drafts rejected at twice plain's cost: 50 tok/s
    assert auto.chosen == "plain"
    chunk(1, 0, 0.010)
    chunk(1, 0, 0.010)  # 100 tok/s
    used = []
    for _ in range(2):  # plain for 8 // 4 chunks, then suffix again
        used.append(auto.chosen)
        chunk(1, 0, 0.010)
    assert used == ["plain", "plain"] and auto.chosen == "suffix"


def test_a_trial_waits_for_drafts_only_so_long():
    auto = AutoDrafter({"suffix": Fixed(5), "plain": None}, probe_chunks=2, exploit_chunks=8)
    draft(auto, True)
    for _ in range(2 * ad.EMPTY_TRIAL_FACTOR):
        auto.observe(1, by="suffix", drafted=0)
    assert auto.chosen == "plain" and auto.stats["suffix"].chunks == 0
    auto.observe(1, by="plain", drafted=0)
    auto.observe(1, by="plain", drafted=0)
    assert auto.best() == "plain"  # a drafter that never drafted is not chosen


def test_a_chosen_drafter_that_stops_drafting_still_gives_the_others_their_turn(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(ad.time, "perf_counter", lambda: now[0])
    auto = AutoDrafter({"suffix": Fixed(5), "draft": Fixed(6), "plain": None}, probe_chunks=1, exploit_chunks=4)
    for name, tokens in (("suffix", 4), ("draft", 2), ("plain", 1)):
        draft(auto, True)
        assert auto.chosen == name
        now[0] += 0.01
        auto.observe(tokens, by=name, drafted=4 if name != "plain" else 0)
    assert auto.chosen == "suffix"
    for _ in range(4):  # the text stops repeating: no more matches
        draft(auto, True)
        auto.observe(1, by="suffix", drafted=0)
    assert auto.chosen == "draft"  # its turn ended all the same: the others are tried again
    # and a generation where no drafter ever drafts ends up plain
    idle = AutoDrafter({"suffix": Fixed(5), "plain": None}, probe_chunks=1)
    draft(idle, False)
    for _ in range(ad.EMPTY_TRIAL_FACTOR):
        idle.observe(1, by="suffix", drafted=0)
    assert idle.chosen == "plain"


class Trees(Fixed):
    """A drafter of trees (as ModelDrafter): its chain and one branch beside its first token."""

    drafts_trees = True

    def propose_tree(self, ids, k, branches=None):
        return [self.token] * k + [self.token + 1], list(range(-1, k - 1)) + [-1]


def test_trees_are_drafted_only_while_a_drafter_of_trees_is_chosen():
    auto = AutoDrafter({"draft": Trees(5), "suffix": Fixed(7), ad.PLAIN: None})
    assert auto.chosen == "draft" and auto.drafts_trees
    assert auto.propose_tree([1, 2], 3) == ([5, 5, 5, 6], [-1, 0, 1, -1])
    assert auto.greedy is True  # a tree is a greedy proposal
    auto.current = "suffix"
    assert not auto.drafts_trees


def test_a_greedy_generation_starts_from_the_last_ones_figures(monkeypatch):
    """A client's next greedy AutoDrafter begins with the candidate the last one found best (its
    figures at half weight) and skips the first round of trials; a sampled one, or one over
    other candidates, starts afresh."""
    now = [0.0]
    monkeypatch.setattr(ad.time, "perf_counter", lambda: now[0])
    cost = {"draft": 0.010, "suffix": 0.010, "plain": 0.010}

    def clock(name):
        now[0] += cost[name]

    def auto():
        return AutoDrafter({"draft": Fixed(5), "suffix": Fixed(6), "plain": None}, probe_chunks=3, exploit_chunks=12)

    first = auto()
    run(first, {"draft": 4, "suffix": 2, "plain": 1}, 9, clock, greedy=True)  # the trials: draft yields most
    nxt = auto()
    nxt.start_from(first)
    used = run(nxt, {"draft": 4, "suffix": 2, "plain": 1}, 12, clock, greedy=True)
    assert used == ["draft"] * 12  # no trial of the others first; they are tried when its turn ends:
    assert nxt.choices == [("draft", 0), ("suffix", 12)]
    assert nxt.stats["draft"].chunks == 2 + 12 and nxt.stats["suffix"].tokens == 3  # half of 3 chunks' 6
    sampled = auto()
    sampled.start_from(first)
    assert run(sampled, {"draft": 4, "suffix": 2, "plain": 1}, 3)[:3] == ["draft"] * 3  # its own trials
    assert sampled.stats["suffix"].chunks == 0
    other = AutoDrafter({"suffix": Fixed(6), "plain": None})
    other.start_from(first)
    assert other.prior is None


def test_a_tree_asked_of_a_candidate_without_trees_is_its_chain_or_nothing():
    auto = AutoDrafter({"suffix": Fixed(7), ad.PLAIN: None})
    assert not auto.drafts_trees and auto.greedy is True  # asking settles the mode
    assert auto.propose_tree([1, 2], 3) == ([7, 7, 7], [-1, 0, 1])
    auto.current = ad.PLAIN
    assert auto.propose_tree([1, 2], 3) == ([], [])
