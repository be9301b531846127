"""Lossless speculative sampling over trees of drafts (``accept_sampled_tree``): the tokens it
yields have exactly the target's distribution, checked against the exact probabilities by a
chi-square goodness-of-fit test, and the test has the power to see a broken rule."""

from collections import Counter

import pytest
import torch

from shardnet.inference.client.sampling import Randomness, draw
from shardnet.inference.client.speculative import accept_sampled, accept_sampled_tree

V = 6  # a vocabulary of six tokens; target and draft are Markov chains over it (next given last)
GEN = torch.Generator().manual_seed(5)
TARGET = torch.softmax(2.0 * torch.randn(V, V, generator=GEN), -1)  # TARGET[t]: the next token's distribution
DRAFT = torch.softmax(TARGET.log() + 1.2 * torch.randn(V, V, generator=GEN), -1)  # close to it, not equal


def tree_round(last: int, start: int, rng: Randomness, k: int, branches: int, accept=accept_sampled_tree):
    """One traversal after the token ``last`` at position ``start`` - 1: a sampled chain of ``k``
    and a second draw beside its first ``branches`` drafts (as ``ModelDrafter.sample_tree``), the
    target's rows after the text and after each draft, and the tokens accepted."""
    chain, qs, at = [], [], last
    for d in range(k):
        q = DRAFT[at]
        chain.append(draw(q, rng.uniform(start + d, "draft")))
        qs.append(q)
        at = chain[-1]
    second = [draw(qs[d], rng.uniform(start + d, "draft-1")) for d in range(branches)]
    tokens = chain + second
    parents = list(range(-1, k - 1)) + [d - 1 for d in range(branches)]
    q = torch.stack(qs + qs[:branches])
    p = torch.stack([TARGET[last]] + [TARGET[t] for t in tokens])
    path, bonus = accept(tokens, parents, q, p, rng, start)
    return [tokens[i] for i in path] + [bonus]


def sample_pairs(n: int, k: int, branches: int, accept=accept_sampled_tree) -> Counter:
    """The first two tokens after the token 0, by traversals until there are two, seeds 0..n-1."""
    counts: Counter = Counter()
    for seed in range(n):
        rng, out = Randomness(seed), []
        while len(out) < 2:
            out += tree_round(out[-1] if out else 0, 1 + len(out), rng, k, branches, accept)
        counts[tuple(out[:2])] += 1
    return counts


def fit_pvalue(counts: Counter, n: int) -> float:
    """Chi-square goodness of fit of the pairs' counts to the target's exact probabilities
    (cells expected under 5 pooled), as an upper-tail probability."""
    cells, pool = [], [0.0, 0.0]
    for a in range(V):
        for b in range(V):
            expected = n * float(TARGET[0, a] * TARGET[a, b])
            if expected < 5:
                pool[0] += counts[(a, b)]
                pool[1] += expected
            else:
                cells.append((counts[(a, b)], expected))
    if pool[1] > 0:
        cells.append(tuple(pool))
    stat = sum((obs - exp) ** 2 / exp for obs, exp in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("k,branches", [(1, 1), (2, 2), (3, 1)])
def test_tree_sampling_has_the_target_distribution(k, branches):
    """N = 4000 seeded pairs: the test rejects a right sampler at p < 0.001 once in a thousand
    runs (the seeds are fixed, so it either passes or fails every time)."""
    n = 4000
    assert fit_pvalue(sample_pairs(n, k, branches), n) > 1e-3


def test_the_fit_sees_a_sibling_tried_against_the_target_instead_of_the_residual():
    """The power check: a second child tried against the target's own distribution (not the
    residual after the first child's rejection) over-produces the draft's likely tokens."""

    def against_p(tokens, parents, q, p, rng, start):
        path, at = [], -1
        while True:
            children = [i for i, parent in enumerate(parents) if parent == at]
            row = p[at + 1]
            for j, i in enumerate(children):
                if rng.uniform(start + len(path), f"accept-{j}") * float(q[i, tokens[i]]) < float(row[tokens[i]]):
                    path.append(i)
                    at = i
                    break
            else:
                return path, draw(row, rng.uniform(start + len(path), "target"))

    n = 4000
    assert fit_pvalue(sample_pairs(n, 2, 2, accept=against_p), n) < 1e-6


def test_a_chain_as_a_tree_keeps_what_chain_sampling_keeps():
    """One child per node: the same tokens as ``accept_sampled`` for the same numbers."""
    for seed in range(200):
        rng = Randomness(seed)
        drafts = [int(t) for t in torch.randint(0, V, (3,), generator=torch.Generator().manual_seed(seed))]
        q = torch.stack([DRAFT[t] for t in [0] + drafts[:-1]])
        p = torch.stack([TARGET[t] for t in [0] + drafts])
        path, bonus = accept_sampled_tree(drafts, [-1, 0, 1], q, p, rng, 1)
        assert [drafts[i] for i in path] + [bonus] == accept_sampled(drafts, q, p, rng, 1)
