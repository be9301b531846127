"""Route planning with and without sub-span hops (issue 39): planning time and the chain's cost.

    python -m bench.plan_routes [--claims 1000,10000] [--layers 80] [--repeats 3] [--quick]

Synthetic swarms of ``--claims`` claims on a model of ``--layers`` layers, every claim saying
``sub_spans``, each with 8 reported round trips to random peers and the client's round trip to
each peer drawn at random (10-200 ms): *aligned* spans (lengths 2, 4, 5, 8 or 10, each starting
at a multiple of its length, as placement's windows of one size would) and *random* spans
(lengths 2-12 at any start). For each, ``plan_route`` with ``ChainCost`` over whole spans and with
``sub_spans=True`` (claims cut at any boundary where another claim starts or ends), side by side:
the median planning time of ``--repeats`` and the planned chain's estimated seconds per token.
Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import random
import statistics
import time

from bench._common import bench_parser, print_table
from shardnet.errors import NoRouteError
from shardnet.inference.client.routing import ChainCost, plan_route
from shardnet.testing.factories import claim


def world(n: int, layers: int, aligned: bool, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.choice([2, 4, 5, 8, 10]) if aligned else rng.randint(2, 12)
        k = min(k, layers)
        a = rng.randrange(0, layers // k) * k if aligned else rng.randrange(0, layers - k + 1)
        rtts = tuple((f"p{rng.randrange(n)}", rng.uniform(0.005, 0.1)) for _ in range(8))
        out.append(claim(peer=f"p{i}", start=a, end=min(layers, a + k), tput=rng.uniform(5, 50), sub_spans=True,
                         rtts=rtts))
    return out


def measure(claims: list, layers: int, sub_spans: bool, repeats: int) -> tuple[float, float | None, int]:
    """Median planning seconds, the chain's estimated seconds per token (None: no route), its hops."""
    rtt = {c.peer: random.Random(c.peer).uniform(0.01, 0.2) for c in claims}
    cost = ChainCost(lambda peer: rtt[peer])
    times, route = [], None
    for r in range(repeats):
        t0 = time.perf_counter()
        try:
            route = plan_route(claims, layers, cost=cost, sub_spans=sub_spans, rng=random.Random(r))
        except NoRouteError:
            route = None
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (cost.total(route) if route else None), len(route or ())


def main() -> None:
    ap = bench_parser(__doc__, quick="200 claims on 24 layers, one repeat")
    ap.add_argument("--claims", default="1000,10000")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.claims, args.layers, args.repeats = "200", 24, 1
    rows = []
    for n in [int(x) for x in args.claims.split(",")]:
        for aligned in (True, False):
            claims = world(n, args.layers, aligned, seed=1)
            whole = measure(claims, args.layers, False, args.repeats)
            sub = measure(claims, args.layers, True, args.repeats)

            def chain(m):
                return "no route" if m[1] is None else f"{m[1] * 1000:.1f} ms, {m[2]} hops"

            rows.append([n, "aligned" if aligned else "random", f"{whole[0] * 1000:.0f} ms", chain(whole),
                         f"{sub[0] * 1000:.0f} ms", chain(sub), f"{sub[0] / whole[0]:.1f}x"])
    print_table(f"plan_route over synthetic swarms of {args.layers} layers (median of {args.repeats}): "
                f"whole spans against sub-spans",
                ["claims", "spans", "whole: time", "whole: chain per token", "sub-spans: time",
                 "sub-spans: chain per token", "time ratio"], rows, left=2)


if __name__ == "__main__":
    main()
