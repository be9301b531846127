"""The throughput law (shardnet/inference/client/throughput.py) against its closed forms and against a
simulation of the decode loop's chunk outcomes."""

import random
import statistics

import pytest

from shardnet.inference.client.speculative import SpeculationStats
from shardnet.inference.client.throughput import (
    TreeShaper,
    best_plan,
    best_tree,
    ceiling,
    expected_rate,
    tree_tokens,
)

RING, DRAFT, SERVICE = 0.1, 0.006, 0.01


def test_plain_and_single_chunk_closed_forms():
    assert expected_rate(0.9, 0, 1, RING, 0, 0) == pytest.approx(10.0)
    for alpha in (0.0, 0.5, 0.9):
        for k in (1, 4, 8):
            want = sum(alpha**i for i in range(k + 1)) / (RING + DRAFT)  # 1 + a + ... + a^k tokens per turn
            assert expected_rate(alpha, k, 1, RING, DRAFT, SERVICE) == pytest.approx(want)
    assert expected_rate(1.0, 4, 1, RING, DRAFT, SERVICE) == pytest.approx(5 / (RING + DRAFT))
    assert expected_rate(1.0, 4, 4, RING, DRAFT, SERVICE) == pytest.approx(4 / ((RING + DRAFT) / 4))
    assert expected_rate(1.0, 4, 100, RING, DRAFT, SERVICE) == pytest.approx(4 / SERVICE)  # drafting-bound


def _simulate(alpha: float, k: int, depth: int, tokens_wanted: int, rng: random.Random) -> float:
    """Chunk by chunk, as the decode loop acts: each draft kept with probability alpha; a chunk
    kept whole is carried when another is in flight (depth > 1), else it ends the cycle with its
    bonus token; a rejection ends the cycle with the target's token."""
    turn = RING + DRAFT
    spacing = max(SERVICE, turn / depth)
    tokens, seconds, fresh = 0, 0.0, True
    while tokens < tokens_wanted:
        kept = 0
        while kept < k and rng.random() < alpha:
            kept += 1
        seconds += turn if fresh else spacing
        if kept == k and depth > 1:
            tokens += k
            fresh = False
        else:
            tokens += kept + 1
            fresh = True
    return tokens / seconds


@pytest.mark.parametrize("alpha,k,depth", [(0.6, 3, 2), (0.8, 4, 4), (0.9, 6, 4), (0.95, 8, 8)])
def test_pipelined_law_matches_a_simulation(alpha, k, depth):
    simulated = _simulate(alpha, k, depth, 400_000, random.Random(1))
    assert expected_rate(alpha, k, depth, RING, DRAFT, SERVICE) == pytest.approx(simulated, rel=0.02)


def test_ceiling_of_single_chunk_runs_is_one_turn_per_chunk():
    st = SpeculationStats(chunks=10, verified=10, drafted=40, accepted=30, tokens=40)
    assert ceiling(st, 1, RING, DRAFT, SERVICE) == pytest.approx(40 / (10 * (RING + DRAFT)))
    carried = SpeculationStats(chunks=12, verified=10, carried=6, stale=2, drafted=40, accepted=36, tokens=44)
    # 4 cycles pay a full turn, 6 carried chunks the pipeline's spacing
    want = 44 / (4 * (RING + DRAFT) + 6 * max(SERVICE, (RING + DRAFT) / 4))
    assert ceiling(carried, 4, RING, DRAFT, SERVICE) == pytest.approx(want)


def test_best_plan_pipelines_only_when_whole_chunks_are_likely():
    k, depth, rate = best_plan(0.95, RING, 0.001, 0.002)
    assert depth > 1 and k >= 4 and rate > 5 * expected_rate(0.95, 0, 1, RING, 0, 0)
    k, depth, _ = best_plan(0.0, RING, 0.001, 0.002)
    assert (k, depth) == (0, 1)  # drafts that are never accepted only cost time


@pytest.mark.parametrize("alpha,beta,k,branches", [(0.75, 0.8, 6, 6), (0.5, 0.3, 4, 2), (0.9, 0.5, 8, 0)])
def test_the_tree_law_matches_a_simulation_of_accept_greedy_tree(alpha, beta, k, branches):
    """Trees of a chain and second choices beside it, drawn at random and accepted by the
    decode loop's own rule (speculative.accept_greedy_tree); counted by its own bookkeeping
    (decode._count_tree), which must find alpha and beta again."""
    from shardnet.inference.client.decode import _count_tree
    from shardnet.inference.client.speculative import accept_greedy_tree

    rng = random.Random(2)
    parents = list(range(-1, k - 1)) + [d - 1 for d in range(branches)]
    tokens_in_tree = list(range(k)) + [100 + d for d in range(branches)]
    stats, total, n = SpeculationStats(), 0, 40_000
    for _ in range(n):
        target = []  # the target's token after the root and after each chain draft
        for d in range(k + 1):
            if d < k and rng.random() < alpha:
                target.append(d)  # agrees with the chain's draft at depth d
            else:
                right = d < branches and rng.random() < beta
                target.append(100 + d if right else -1)
                break
        path, _ = accept_greedy_tree(tokens_in_tree, parents, _targets(tokens_in_tree, parents, target))
        total += len(path) + 1
        _count_tree(stats, parents, path)
    assert total / n == pytest.approx(tree_tokens(alpha, beta, k, branches), rel=0.02)
    a, b = stats.tree_rates
    assert a == pytest.approx(alpha, abs=0.01)
    if branches:
        assert b == pytest.approx(beta, abs=0.02)


def _targets(tokens: list[int], parents: list[int], target: list[int]) -> list[int]:
    """``accept_greedy_tree``'s target_tokens: the target's choice after the root, then after
    each draft (what the target picks after the text up to it: known on the chain, else never
    matched)."""
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    on_chain = [i == d for i, d in enumerate(depth)]  # (the chain is drafts 0..k-1, at depths 0..k-1)
    return [target[0]] + [target[d + 1] if on_chain[i] and d + 1 < len(target) else -3
                          for i, d in enumerate(depth)]


def test_best_tree_takes_branches_where_latency_dominates():
    k, branches, _ = best_tree(0.75, 0.8, latency=0.044, per_position=0.0002, draft_per_token=0.001)
    assert branches == k and k >= 6  # a WAN traversal: positions are cheap next to the trip
    k, branches, _ = best_tree(0.75, 0.1, latency=0.044, per_position=0.0002, draft_per_token=0.001)
    assert 0 < branches < k  # second choices seldom right: only the likeliest are worth a position
    assert best_tree(0.75, 0.8, latency=0.0005, per_position=0.003, draft_per_token=0.001)[:2] == (0, 0)
    # (compute-bound, a position costing six trips: plain decoding)


def test_tree_shaper_fits_the_trips_and_follows_the_measured_rates():
    shaper = TreeShaper(12)
    stats = SpeculationStats()
    assert shaper.shape(stats) == (4, 4)  # nothing measured: a middling tree, the first measure
    for n in (9, 5, 13, 9, 3, 17):  # a 10 ms WAN's trips: 44 ms and 0.25 ms a position
        shaper.trip(n, 0.044 + 0.00025 * n)
    latency, per_position = shaper.cost()
    assert latency == pytest.approx(0.044, rel=0.01) and per_position == pytest.approx(0.00025, rel=0.05)
    shaper.drafting(60, 0.06)
    stats.chain_tried, stats.chain_kept, stats.branch_tried, stats.branch_kept = 1000, 770, 200, 128
    k, branches = shaper.shape(stats)
    assert (k, branches) == best_tree(0.77 * 1000 / 1008 + 0.7 * 8 / 1008, (128 + 4) / 208, latency,
                                      per_position, 0.001)[:2]
    assert k >= 6 and branches >= k - 2  # trips dominate: a deep tree, a branch at nearly every depth
    stats.chain_tried, stats.chain_kept, stats.branch_tried, stats.branch_kept = 1000, 100, 900, 5
    assert shaper.shape(stats)[0] <= 2  # drafts seldom right: a small tree


def test_tree_shaper_keeps_its_prior_per_position_while_trips_are_one_size():
    shaper = TreeShaper(6)
    for _ in range(10):
        shaper.trip(9, 0.05)
    latency, per_position = shaper.cost()
    assert per_position == pytest.approx(TreeShaper.PER_POSITION)
    assert latency == pytest.approx(0.05 - 9 * TreeShaper.PER_POSITION)
    stats = SpeculationStats(chain_tried=100, chain_kept=99, branch_tried=1, branch_kept=1)
    assert shaper.shape(stats)[0] == 6  # capped at max_k
    assert TreeShaper(6, fixed=(3, 1)).shape(stats) == (3, 1)


def test_a_tree_shaper_goes_on_from_the_previous_generations():
    before = TreeShaper(12)
    for n in (9, 13, 17):
        before.trip(n, 0.04 + 0.0002 * n)
    before.drafting(10, 0.01)
    stats = SpeculationStats(chain_tried=500, chain_kept=450, branch_tried=50, branch_kept=40)
    before.shape(stats)
    after = TreeShaper(12)
    after.start_from(before)
    assert after.trips == before.trips and after.cost() == before.cost()
    assert after.rates(SpeculationStats()) == pytest.approx(before.rates(stats))  # its rates: the prior
    assert after.shape(SpeculationStats()) == before.shape(stats)


def test_a_tree_shaper_leaves_out_a_heals_trip_and_keeps_probing_where_plain_wins():
    shaper = TreeShaper(12)
    for n in (9, 13, 17, 11) * 8:
        shaper.trip(n, 0.04 + 0.0002 * n)
    latency, per_position = shaper.cost()
    shaper.trip(25, 8.0)  # a trip that spanned probes and a replay
    assert shaper.cost() == pytest.approx((latency, per_position))
    shaper.drafting(4, 0.5)  # a first draft that also fed the draft the prompt
    for _ in range(4):
        shaper.drafting(4, 0.004)
    assert statistics.median(shaper.drafts) == pytest.approx(0.001)
    local = TreeShaper(12)  # compute-bound: plain steps, and every PROBE_EVERY-th a small tree
    for _ in range(10):
        local.trip(1, 0.0005)
        local.trip(9, 0.0005 + 8 * 0.003)
    local.drafting(2, 0.004)
    shapes = [local.shape(SpeculationStats(chain_tried=100, chain_kept=30)) for _ in range(2 * TreeShaper.PROBE_EVERY)]
    assert shapes.count((0, 0)) == 2 * TreeShaper.PROBE_EVERY - 2 and shapes.count((2, 2)) == 2
    assert TreeShaper(400).max_k == TreeShaper.MAX_K
