"""The throughput law of (pipelined) speculative decoding over a chain, and the ceiling it puts
on a measured run. docs/performance.md derives it.

Quantities, in seconds: ``ring`` is one verify chunk's trip (client -> every peer -> client,
compute included); ``draft`` is the client's time to draft one chunk; ``service`` is the least
time between two results when the chain is kept busy (the slowest stage per chunk: usually the
client's drafting plus its own per-chunk work).
"""

from __future__ import annotations

import statistics

from shardnet.inference.client.speculative import SpeculationStats

#: the most drafts in a tree's chain that a shape chosen by ``TreeShaper`` holds by default
TREE_MAX_K = 12


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


class TreeShaper:
    """Each tree's shape, (k, branches), chosen by ``best_tree`` from what was measured: the
    trees' alpha and beta (``SpeculationStats.tree_rates``, pulled towards ``prior`` while few
    drafts were tried), a traversal's fixed cost and its cost per position (a least-squares line
    through the last ``WINDOW`` trips' (positions, seconds), trips over ``OUTLIER`` times their
    median left out, its slope pulled towards ``PER_POSITION`` while their sizes hardly differ),
    and drafting's time per token (the median over the last ``WINDOW`` trees: a draft's first
    call also feeds it the prompt). A trip counts the client's own work on the step too
    (embedding and sending it, the head over its rows), not what it does per token accepted. A
    shaper that starts from the one of the client's previous generation (``start_from``) keeps
    its measurements and takes its rates as the prior, so a short generation does not learn its
    chain's costs afresh. Where plain steps rank first, every
    ``PROBE_EVERY``-th step is still a small tree, so that what is measured stays current. At
    most ``max_k`` (up to ``MAX_K``) drafts in the chain and as many branches; ``fixed``: always
    that shape."""

    PRIOR = (0.7, 0.5)  # alpha and beta before any tree was verified
    PRIOR_WEIGHT = 8.0  # drafts' worth of weight the prior carries
    PER_POSITION = 2.5e-4  # seconds per position before the trips say otherwise (the shipped model, CPU)
    SPREAD = 16.0  # positions^2 of weight that prior carries
    WINDOW = 64  # the trips (and trees' drafting times) measurements are taken over, the most recent
    OUTLIER = 4.0  # a trip this many times the window's median is left out of the line
    PROBE_EVERY = 16
    MAX_K = 16  # (best_tree's search grows as k^3)

    def __init__(self, max_k: int, *, fixed: tuple[int, int] | None = None) -> None:
        self.max_k, self.fixed = min(max_k, self.MAX_K), fixed
        self.prior = self.PRIOR
        self.trips: list[tuple[int, float]] = []  # (positions, seconds)
        self.drafts: list[float] = []  # seconds per draft token, per tree
        self.rates_seen = self.PRIOR  # the rates the last shape was chosen with
        self.plain_run = 0  # plain steps chosen in a row

    def start_from(self, previous: TreeShaper) -> None:
        """Go on from the client's previous generation's measurements (its trips and drafting
        times; its last rates as this one's prior)."""
        self.trips, self.drafts = list(previous.trips), list(previous.drafts)
        self.prior = self.rates_seen = previous.rates_seen

    def trip(self, positions: int, seconds: float) -> None:
        """A step of ``positions`` positions (its root included) cost ``seconds`` from its drafts to
        its logits."""
        self.trips = self.trips[-(self.WINDOW - 1):] + [(positions, seconds)]

    def drafting(self, drafts: int, seconds: float) -> None:
        if drafts > 0:
            self.drafts = self.drafts[-(self.WINDOW - 1):] + [seconds / drafts]

    def cost(self) -> tuple[float, float]:
        """The traversal's fixed seconds and seconds per position, as the trips measured them."""
        if not self.trips:
            return 0.0, self.PER_POSITION
        typical = statistics.median(y for _, y in self.trips)
        trips = [(x, y) for x, y in self.trips if y <= self.OUTLIER * typical]
        n = len(trips)
        mean_x = sum(x for x, _ in trips) / n
        mean_y = sum(y for _, y in trips) / n
        sxx = sum((x - mean_x) ** 2 for x, _ in trips)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in trips)
        per_position = max(0.0, (sxy + self.SPREAD * self.PER_POSITION) / (sxx + self.SPREAD))
        return max(0.0, mean_y - per_position * mean_x), per_position

    def estimates(self) -> dict[str, float]:
        """What the last shape was chosen from: the trip's fixed and per-position seconds, the
        drafting seconds per token, alpha and beta."""
        latency, per_position = self.cost()
        return {"latency": latency, "per_position": per_position,
                "draft": statistics.median(self.drafts) if self.drafts else 0.0,
                "alpha": self.rates_seen[0], "beta": self.rates_seen[1]}

    def rates(self, stats: SpeculationStats) -> tuple[float, float]:
        w, (a, b) = self.PRIOR_WEIGHT, self.prior
        return ((stats.chain_kept + a * w) / (stats.chain_tried + w),
                (stats.branch_kept + b * w) / (stats.branch_tried + w))

    def shape(self, stats: SpeculationStats) -> tuple[int, int]:
        """The next tree's (k, branches); (0, 0): a plain step."""
        if self.fixed is not None:
            return self.fixed
        if not self.trips:  # nothing measured yet: a middling tree, whose trip is the first measure
            return min(self.max_k, 4), min(self.max_k, 4)
        self.rates_seen = self.rates(stats)
        e = self.estimates()
        k, branches, _ = best_tree(e["alpha"], e["beta"], e["latency"], e["per_position"], e["draft"],
                                   max_k=self.max_k)
        self.plain_run = self.plain_run + 1 if k == 0 else 0
        if k == 0 and self.plain_run % self.PROBE_EVERY == 0:
            return min(self.max_k, 2), min(self.max_k, 2)
        return k, branches
