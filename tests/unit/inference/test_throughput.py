"""The throughput law (shardnet/inference/client/throughput.py) against its closed forms and against a
simulation of the decode loop's chunk outcomes."""

import random

import pytest

from shardnet.inference.client.speculative import SpeculationStats
from shardnet.inference.client.throughput import best_plan, ceiling, expected_rate

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
