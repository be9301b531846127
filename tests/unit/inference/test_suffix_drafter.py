"""The suffix drafter: longest match, most frequent continuation, drafts taken back when rejected."""

import random

import pytest
import torch

from shardnet.inference.client.sampling import Randomness, SamplingParams
from shardnet.inference.client.speculative import NGramDrafter
from shardnet.inference.client.suffix_drafter import SuffixCache, SuffixDrafter, SuffixTrie


def counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.children.items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


def test_the_longest_match_wins_over_the_latest_short_one():
    text = [1, 2, 3, 4, 5, 6, 7, 0, 3, 4, 5, 9, 8, 2, 3, 4, 5]
    assert SuffixDrafter().propose(text, 2) == [6, 7]  # "2 3 4 5" went on with 6 7
    assert NGramDrafter().propose(text, 2) == [9, 8]  # the latest "3 4 5" went on with 9


def test_the_most_frequent_continuation_wins_over_the_latest():
    text = [7, 8, 1, 7, 8, 1, 7, 8, 2, 7, 8]  # "2 7 8" is new; "7 8" went on with 1 twice, then 2
    assert SuffixDrafter().propose(text, 1) == [1]
    assert NGramDrafter().propose(text, 1) == [2]


def test_drafting_stops_where_the_text_went_many_ways():
    text = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6, 4, 5, 6]  # after "5 6": four ways, a quarter each
    assert SuffixDrafter(min_share=0.5).propose(text, 3) == [4]  # the first draft is always made (the latest)
    assert SuffixDrafter(min_share=0.2).propose(text, 3) == [4, 5, 6]


def test_nothing_to_continue_proposes_nothing():
    d = SuffixDrafter()
    assert d.propose([1, 2, 3], 4) == []
    assert d.propose([], 4) == []
    assert d.propose([1, 2, 1], 0) == []


@pytest.mark.parametrize("seed", range(5))
def test_rejected_drafts_are_taken_back_exactly(seed):
    """Asked about texts that share ever-changing prefixes (accepted text plus drafts in flight,
    then drafts rejected), the trie holds what a fresh one built from the last text holds."""
    rng = random.Random(seed)
    d = SuffixDrafter(depth=6)
    text = [rng.randrange(5) for _ in range(40)]
    for _ in range(30):
        keep = rng.randrange(len(text) // 2, len(text) + 1)
        text = text[:keep] + [rng.randrange(5) for _ in range(rng.randrange(0, 8))]
        d.propose(text, 3)
        fresh = SuffixTrie(6)
        fresh.feed(text)
        assert counts(d.trie) == counts(fresh)
        assert len(d.trie) == len(text)


def test_a_shared_cache_drafts_what_earlier_outputs_said():
    cache = SuffixCache(max_tokens=100)
    cache.add([40, 41, 42, 43, 44])
    d = SuffixDrafter(cache=cache)
    assert d.propose([9, 9, 41, 42], 2) == [43, 44]
    assert SuffixDrafter().propose([9, 9, 41, 42], 2) == []


def test_the_shared_cache_keeps_its_last_outputs_within_its_size():
    cache = SuffixCache(max_tokens=10, depth=4)
    for i in range(50):
        cache.add([100 + i, 1, 2, 3])
    assert cache.tokens <= 10 and len(cache.tries) == 2
    assert SuffixDrafter(cache=cache).propose([7, 149, 1], 2) == [2, 3]
    assert SuffixDrafter(cache=cache).propose([7, 100, 1], 2) == [2, 3]  # (1 2 3 is everywhere)
    assert all(counts(t).get((100,)) is None for t in cache.tries)  # the first outputs are gone
    cache.add(list(range(200, 230)))  # an output longer than the cache: its end
    assert cache.tokens == 10 and len(cache.tries) == 1
    assert SuffixDrafter(cache=cache).propose([5, 221, 222], 3) == [223, 224, 225]


def test_sampling_drafts_are_point_masses_within_the_vocabulary():
    d = SuffixDrafter()
    tokens, q = d.sample([3, 4, 99, 3, 4], 2, SamplingParams(temperature=0.8), Randomness(0), vocab_size=50)
    assert tokens == [] and q.shape == (0, 50)  # 99 is past the vocabulary: nothing after it drafted
    tokens, q = d.sample([3, 4, 5, 3, 4], 2, SamplingParams(temperature=0.8), Randomness(0), vocab_size=50)
    assert tokens == [5, 3]
    assert torch.equal(q.sum(-1), torch.ones(2)) and q[0, 5] == 1 and q[1, 3] == 1


def test_depth_below_two_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        SuffixTrie(1)


def test_of_equally_frequent_continuations_the_latest_wins():
    text = [7, 8, 1, 0, 7, 8, 2, 0, 7, 8]
    assert SuffixDrafter().propose(text, 1) == [2]


def test_a_long_repeat_drafts_all_k_tokens_past_the_tries_depth():
    text = list(range(50)) * 3  # every match is as long as the trie allows
    assert SuffixDrafter(depth=8).propose(text, 8) == list(range(8))
    assert SuffixDrafter().propose(list(range(10)) * 5, 12) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_a_tree_holds_every_way_the_text_went_most_likely_first():
    # after "1 2" the text went on "3 4" twice and "5 6" once (each time after another token)
    text = [7, 1, 2, 3, 4, 8, 1, 2, 5, 6, 9, 1, 2, 3, 4, 10, 1, 2]
    tokens, parents = SuffixDrafter().propose_tree(text, 4)
    # by probability: 3 and 3-4 2/3, then 5, 3-4-8 and 3-4-10 and 5-6 1/3 each (ties: the earlier found first)
    assert list(zip(tokens, parents)) == [(3, -1), (4, 0), (5, -1), (8, 1)]
    assert SuffixDrafter().propose_tree(text, 0) == ([], []) and SuffixDrafter().propose_tree([7, 8], 4) == ([], [])


def test_greedy_tree_acceptance_follows_the_targets_path():
    from shardnet.inference.client.speculative import accept_greedy, accept_greedy_tree

    tokens, parents = [3, 5, 4, 6, 7], [-1, -1, 0, 1, 2]
    # the target says 5 after the text, then 6, then 8: the second branch, then its bonus
    target = [5, 0, 6, 0, 8, 0]  # after the text, then after each draft (only those on its path are read)
    assert accept_greedy_tree(tokens, parents, target) == ([1, 3], 8)
    assert accept_greedy_tree(tokens, parents, [2] + [0] * 5) == ([], 2)
    # a chain is the one-branch tree
    drafts, after = [3, 4, 7], [3, 4, 9, 1]
    path, bonus = accept_greedy_tree(drafts, [-1, 0, 1], after)
    assert [drafts[i] for i in path] + [bonus] == accept_greedy(drafts, after)
