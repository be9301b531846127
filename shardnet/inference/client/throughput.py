"""The throughput law of (pipelined) speculative decoding over a chain, and the ceiling it puts
on a measured run. docs/performance.md derives it.

Quantities, in seconds: ``ring`` is one verify chunk's trip (client -> every peer -> client,
compute included); ``draft`` is the client's time to draft one chunk; ``service`` is the least
time between two results when the chain is kept busy (the slowest stage per chunk: usually the
client's drafting plus its own per-chunk work).
"""

from __future__ import annotations

from shardnet.inference.client.speculative import SpeculationStats


def expected_rate(alpha: float, k: int, depth: int, ring: float, draft: float, service: float) -> float:
    """Tokens per second when each draft is accepted with probability ``alpha`` independently,
    ``k`` drafts per chunk and ``depth`` chunks in flight (k = 0: plain decoding)."""
    if k == 0:
        return 1.0 / ring
    turn = ring + draft  # from deciding to draft a chunk to acting on its result
    if alpha >= 1.0:
        return k / max(service, turn / depth) if depth > 1 else (k + 1) / turn
    if depth == 1:
        return (1 - alpha ** (k + 1)) / (1 - alpha) / turn
    kept_if_rejected = sum(j * alpha**j * (1 - alpha) for j in range(k)) / (1 - alpha**k)
    whole = alpha**k  # a chunk accepted whole is carried: the next one is already in flight
    carried = whole / (1 - whole)  # expected carried chunks per cycle (geometric)
    tokens = k * carried + kept_if_rejected + 1
    return tokens / (turn + carried * max(service, turn / depth))


def tree_tokens(alpha: float, beta: float, k: int, branches: int) -> float:
    """Expected tokens per traversal of a tree of drafts: a chain of ``k`` drafts, each accepted
    with probability ``alpha`` once its parent was, and beside the first ``branches`` of them a
    second choice, right with probability ``beta`` where the chain's draft at that depth is
    rejected. The chain's (1 - alpha^(k+1)) / (1 - alpha), plus one token for each depth d
    < branches reached and rejected (alpha^d (1 - alpha)) whose branch is right."""
    chain = float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return chain + beta * sum(alpha**d * (1 - alpha) for d in range(min(branches, k)))


def best_tree(alpha: float, beta: float, latency: float, per_position: float, draft_per_token: float, *,
              max_k: int = 12) -> tuple[int, int, float]:
    """The (k, branches) of one chunk at a time that ranks first when a traversal of n positions
    costs ``latency + n * per_position`` plus drafting ``k * draft_per_token`` (branches cost the
    draft nothing: ``ModelDrafter.propose_tree``), and that rate in tokens per second."""
    best = (0, 0, 1.0 / (latency + per_position))
    for k in range(1, max_k + 1):
        for branches in range(k + 1):
            t = latency + (1 + k + branches) * per_position + k * draft_per_token
            rate = tree_tokens(alpha, beta, k, branches) / t
            if rate > best[2] * 1.001:  # prefer the smaller tree on a near-tie
                best = (k, branches, rate)
    return best


def ceiling(stats: SpeculationStats, depth: int, ring: float, draft: float, service: float) -> float:
    """The rate a run with these acceptance outcomes would reach with no overhead beyond the
    ring, drafting and the service time: every cycle (a chunk that ended a run of accepted
    chunks) pays a full turn, every carried chunk only the pipeline's spacing."""
    turn = ring + draft
    spacing = max(service, turn / depth)
    seconds = stats.cycles * turn + stats.carried * spacing
    return stats.tokens / seconds if seconds > 0 else 0.0


def best_plan(alpha: float, ring: float, draft_per_token: float, service_per_chunk: float, *,
              max_k: int = 12, max_depth: int = 8) -> tuple[int, int, float]:
    """The (k, depth) that ``expected_rate`` ranks first, and that rate."""
    best = (0, 1, expected_rate(alpha, 0, 1, ring, 0.0, 0.0))
    for k in range(1, max_k + 1):
        for depth in range(1, max_depth + 1):
            draft = k * draft_per_token
            rate = expected_rate(alpha, k, depth, ring, draft, service_per_chunk + draft)
            if rate > best[2] * 1.001:  # prefer the smaller plan on a near-tie
                best = (k, depth, rate)
    return best
