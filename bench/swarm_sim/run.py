"""Simulate a shardnet swarm at scale and compare placement policies side by side.

    python -m bench.swarm_sim.run [--peers 1000] [--models llama-70b,deepseek-v3] [--hours 1]
                                  [--policies shardnet-before,shardnet,least-served,water-filling]
                                  [--load 0.3]
                                  [--seed 1] [--cohort N] [--probe-order stalest|first] [--view-most 512]
                                  [--jobs N] [--plots DIR] [--json FILE] [--quick]

``shardnet-before`` is shardnet as it was before this simulator found what it fixed (see
docs/scale.md); ``shardnet+suffix``, ``shardnet+full-view``, ``shardnet+edge-follow`` and
``shardnet+follow-crowded`` are what-ifs not in the code (a chain entering a span at any layer;
compute peers deciding from every claim; a compute peer's view following only the ranges of its
first layer and of the layer after its span; a view that keeps following a crowded range).
Every policy runs the same world (the same seed: the same peers, places, sessions and request
arrivals) for ``--hours`` simulated hours; the first 10 minutes (the swarm assembling) are left
out of every figure. One row per model and policy:

- covered: share of the time every layer was served; chains: share of the minutes in which
  the spans lined up into at least one complete chain (a route exists); gaps>60s: layers left unserved longer
  than a minute, and the longest such gap;
- flow/bound: the placement's max flow (what perfect routing could carry through the spans as
  placed) over the LP bound (what any placement of the same peers could), time averages;
- deliv: tokens/s delivered to requests; tok/s p10/p50/p90: per request, output tokens over
  decode time; ttft p50: waiting in line plus prefill;
- healed/h, failed/h: sessions healed around a departed peer, sessions failed (no route, or
  busy past the queue timeout), per hour;
- msgs/peer/s, KB/peer/s (after the warm-up): control messages (claim gossip on the layer
  ranges' topics, DHT RPCs, pings, direct claim requests) per peer per second and their bytes
  (bench/swarm_sim/wire.py; estimated from the protocols' parameters for each publication and
  lookup, claims' sizes measured with the real encoder), with a line per run by kind, the
  claims published (news, refreshes) and how many claims a compute peer's view held at upkeep;
  placed p50/p90: seconds from a peer's start to its first claim; moves/peer/h; route ms: wall
  time of one ``plan_route`` here.

docs/scale.md records runs of this and what the model leaves out.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench._common import bench_parser  # noqa: E402
from bench.swarm_sim.models import MODELS  # noqa: E402
from bench.swarm_sim.policies import POLICIES, Shardnet, make  # noqa: E402
from bench.swarm_sim.sim import Sim  # noqa: E402
from bench.swarm_sim.stats import Stats  # noqa: E402
from bench.swarm_sim.swarm import VIEW_DECIDE_MOST  # noqa: E402


def percentile(values: list[float], q: float, weights: list[int] | None = None) -> float:
    if not values:
        return float("nan")
    pairs = sorted(zip(values, weights or [1] * len(values)))
    total = sum(w for _, w in pairs)
    acc = 0.0
    for v, w in pairs:
        acc += w
        if acc >= q * total:
            return v
    return pairs[-1][0]


def summarize(sim: Sim, stats: Stats, wall: float) -> dict:
    hours = stats.observed_s / 3600 or 1.0
    samples = stats.samples or [{"bound": 0, "flow": 0, "delivered": 0, "peers": 0}]
    mean = lambda key: statistics.fmean(s[key] for s in samples)  # noqa: E731
    rates = [r for r, _ in stats.request_rates]
    weights = [w for _, w in stats.request_rates]
    long_gaps = [g for g, _ in stats.gaps if g > 60]
    return {
        "model": sim.model.name, "policy": sim.policy.name, "peers": sim.target_peers,
        "peers_mean": mean("peers"), "cohort": sim.traffic.cohort, "offered": sim.traffic.offered,
        "covered": stats.covered_s / stats.observed_s if stats.observed_s else 0.0,
        "gaps_over_60s": len(long_gaps), "longest_gap_s": max((g for g, _ in stats.gaps), default=0.0),
        "gaps": stats.gaps,
        "bound": mean("bound"), "flow": mean("flow"), "delivered": mean("delivered"),
        "routable": statistics.fmean(1.0 if s.get("routable") else 0.0 for s in samples),
        "flow_over_bound": mean("flow") / mean("bound") if mean("bound") else 0.0,
        "tps_p10": percentile(rates, 0.1, weights), "tps_p50": percentile(rates, 0.5, weights),
        "tps_p90": percentile(rates, 0.9, weights),
        "ttft_p50": percentile(stats.ttft, 0.5),
        "completed_h": stats.completed / hours, "healed_h": stats.heals / hours,
        "failed_h": sum(stats.failed.values()) / hours, "failed_why": dict(stats.failed),
        "heal_s_p50": percentile(stats.heal_seconds, 0.5),
        "msgs_peer_s": sum(stats.msgs.values()) / max(1.0, stats.observed_peer_s),
        "bytes_peer_s": sum(stats.bytes.values()) / max(1.0, stats.observed_peer_s),
        "msgs": dict(stats.msgs), "bytes": dict(stats.bytes),
        "publications_peer_h": {k: 3600 * v / max(1.0, stats.observed_peer_s) for k, v in stats.publications.items()},
        "news_why": dict(stats.news_why),
        "view_p50": percentile(stats.view_claims, 0.5), "view_p90": percentile(stats.view_claims, 0.9),
        "peer_s": stats.observed_peer_s,
        "placed_p50": percentile(stats.placed_s, 0.5), "placed_p90": percentile(stats.placed_s, 0.9),
        "moves_peer_h": stats.moves / max(1e-9, stats.peers_hours),
        "joins": stats.joins, "leaves": stats.leaves,
        "route_ms": statistics.fmean(stats.route_ms) if stats.route_ms else 0.0,
        "samples": stats.samples, "wall_s": wall, "rates": stats.request_rates,
    }


HEADER = (f"{'model':<12} {'policy':<18} {'peers':>5} {'covered':>7} {'chains':>6} {'gaps>60s':>8} {'flow/bound':>10} "
          f"{'deliv tok/s':>11} {'tok/s p10/p50/p90':>17} {'ttft':>5} {'healed/h':>8} {'failed/h':>8} "
          f"{'msgs/peer/s':>11} {'KB/peer/s':>9} {'placed p50/p90':>14} {'moves/p/h':>9} {'route ms':>8} {'wall':>5}")


def row(s: dict) -> str:
    tps = f"{s['tps_p10']:.1f}/{s['tps_p50']:.1f}/{s['tps_p90']:.1f}"
    placed = f"{s['placed_p50']:.0f}/{s['placed_p90']:.0f}s"
    return (f"{s['model']:<12} {s['policy']:<18} {s['peers_mean']:>5.0f} {100 * s['covered']:>6.1f}% "
            f"{100 * s['routable']:>5.0f}% "
            f"{s['gaps_over_60s']:>8d} {100 * s['flow_over_bound']:>9.1f}% {s['delivered']:>11.0f} {tps:>17} "
            f"{s['ttft_p50']:>4.1f}s {s['healed_h']:>8.0f} {s['failed_h']:>8.0f} {s['msgs_peer_s']:>11.1f} "
            f"{s['bytes_peer_s'] / 1000:>9.1f} "
            f"{placed:>14} {s['moves_peer_h']:>9.2f} {s['route_ms']:>8.1f} {s['wall_s']:>4.0f}s")


KINDS = ("gossip", "dht", "ping", "direct")


def traffic_line(s: dict) -> str:
    """Messages and bytes per peer per second by kind, and the claims published per peer-hour."""
    per = max(1.0, s["peer_s"])
    kinds = ", ".join(f"{k} {s['msgs'].get(k, 0) / per:.1f} ({s['bytes'].get(k, 0) / per / 1000:.1f} KB)"
                      for k in KINDS)
    pubs = s["publications_peer_h"]
    why = ", ".join(f"{k} {v}" for k, v in sorted(s["news_why"].items(), key=lambda kv: -kv[1]))
    view = (f"; claims in a compute peer's view at upkeep p50/p90: {s['view_p50']:.0f}/{s['view_p90']:.0f}"
            if s["view_p50"] == s["view_p50"] else "")  # NaN: no upkeep read a view
    return (f"  {s['model']} / {s['policy']}: msgs/peer/s (KB) {kinds}; claims per peer-hour: news "
            f"{pubs.get('news', 0):.1f}, refreshes {pubs.get('refresh', 0):.1f}; news for: {why}{view}")


#: shardnet as it was before this simulator: no claims of spans being loaded, routes blind to
#: peers' load, probes of the first 64 peers only, placement decided from the claims of 64
#: random providers (the gap rule of plan_move is not undone; claims travel as shardnet's do now)
BEFORE = "shardnet-before"
BEFORE_PROVIDERS = 64
#: shardnet if a chain could enter a peer's span at any layer (what the simulation suggests next)
SUFFIX = "shardnet+suffix"
#: shardnet if compute peers decided from every claim, not from their claims view (the news of
#: their neighbourhood's ranges and their lookups' samples of every range)
FULL_VIEW = "shardnet+full-view"
#: shardnet if a compute peer's view followed only the range of its first layer and that of the
#: layer after its span (not every range its span covers)
EDGE_FOLLOW = "shardnet+edge-follow"
#: shardnet if a compute peer's view kept following a crowded range (before claims_view.CROWDED_NEWS)
FOLLOW_CROWDED = "shardnet+follow-crowded"
VARIANTS = (BEFORE, *POLICIES, SUFFIX, FULL_VIEW, EDGE_FOLLOW, FOLLOW_CROWDED)


def simulate(model: str, policy: str, args) -> dict:
    before = policy == BEFORE
    view_most = args.view_most or None
    if policy == FULL_VIEW:
        chosen = Shardnet(full_view=True, view_most=view_most)
    elif policy == EDGE_FOLLOW:
        chosen = Shardnet(view_most=view_most, follow_edges=True)
    elif policy == FOLLOW_CROWDED:
        chosen = Shardnet(view_most=view_most, follow_crowded=True)
    elif policy == BEFORE:
        chosen = Shardnet(view_most=view_most, providers=BEFORE_PROVIDERS)
    elif policy in (SUFFIX, "shardnet"):
        chosen = Shardnet(view_most=view_most)
    else:
        chosen = make(policy)
    sim = Sim(model=MODELS[model], policy=chosen,
              peers=args.peers, hours=args.hours, seed=args.seed, load=args.load, cohort=args.cohort,
              probe_order="first" if before else args.probe_order, announce_loading=not before,
              route_by_load=not before, reroute_busy=args.reroute_busy, load_step=args.load_step,
              suffix_entry=policy == SUFFIX)
    t0 = time.perf_counter()

    def progress(simulated: float) -> None:
        print(f"  {model} / {policy}: {simulated / 60:.0f} of {args.hours * 60:.0f} simulated minutes "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    stats = sim.run(progress)
    out = summarize(sim, stats, time.perf_counter() - t0)
    out["policy"] = policy
    return out


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, paragraph=True, quick="a short run for the tests: 30 peers for 15 minutes")
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--policies", default=",".join((BEFORE, *POLICIES)),
                    help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--load", type=float, default=0.3,
                    help="offered sessions as a share of what the swarm's KV caches hold at once")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cohort", type=int, default=None, help="sessions per simulated request (default: sized)")
    ap.add_argument("--reroute-busy", action="store_true",
                    help="what if requests refused for KV room routed around the full peers (shardnet waits)")
    ap.add_argument("--load-step", type=float, default=None,
                    help="what if peers republished their claim whenever their load crossed a multiple of this")
    ap.add_argument("--probe-order", choices=("stalest", "first"), default="stalest")
    ap.add_argument("--view-most", type=int, default=VIEW_DECIDE_MOST,
                    help="the most claims of its view a simulated compute peer plans over: samples stand for a "
                         "larger view (0: the whole view, slow at 10,000 peers)")
    ap.add_argument("--plots", type=Path, default=None, help="write PNG plots (needs matplotlib) here")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="runs simulated at once, one process each (default: one per core)")
    args = ap.parse_args(argv)
    if args.quick:
        args.peers, args.hours = 30, 0.25
    runs = [(model, policy) for model in args.models.split(",") for policy in args.policies.split(",")]
    for model, policy in runs:
        if model not in MODELS:
            print(f"error: unknown model {model!r} (known: {', '.join(MODELS)})", file=sys.stderr)
            return 2
        if policy not in VARIANTS:
            print(f"error: unknown policy {policy!r} (known: {', '.join(VARIANTS)})", file=sys.stderr)
            return 2
    print(f"simulating {len(runs)} runs of {args.peers} peers for {args.hours:g} h, {min(args.jobs, len(runs))} "
          f"at a time ...", file=sys.stderr, flush=True)
    print(HEADER, flush=True)
    results = []
    # each run is one process's work (the simulator is pure Python); rows print in the order asked
    with concurrent.futures.ProcessPoolExecutor(max(1, min(args.jobs, len(runs)))) as pool:
        futures = [pool.submit(simulate, model, policy, args) for model, policy in runs]
        for future in futures:
            s = future.result()
            results.append(s)
            print(row(s), flush=True)
    print("control traffic per peer per second, by kind:")
    for s in results:
        print(traffic_line(s))
    for model in dict.fromkeys(s["model"] for s in results):
        s = next(s for s in results if s["model"] == model)
        print(f"({model}: offered {s['offered']:.0f} tok/s, {args.load:g} of the sessions its KV caches hold; "
              f"LP bound ~{s['bound']:.0f} tok/s; cohorts of {s['cohort']} sessions; seed {args.seed})")
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "rates"} for r in results],
                                        indent=1, default=float))
    if args.plots:
        from bench.swarm_sim.plots import plot

        for path in plot(results, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
