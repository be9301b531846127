"""Weights over the swarm: MB/s of a span fetched from 1, 2 and 4 peers, and a joining peer's time to serve.

    python -m bench.weights_fetch [--uplink-mb-per-s 25] [--layers 8] [--hidden 1024] [--quick]
                                  [--join-root /tmp/shardnet-bench-1b] [--skip-join]

1. Sources, side by side (real py-libp2p hosts on loopback in this process, as in
   tests/integration/test_weights_fetch.py): a random checkpoint is written once; for each row a
   fresh swarm is started (a bootstrap, N source nodes each serving the whole checkpoint with
   ``weights_mb_per_s`` set to ``--uplink-mb-per-s``, and a fetching node) and the span of every
   layer (``span_tensor_names(ckpt, 0, N)``: with its edges' head parts, the whole checkpoint) is
   fetched into a fresh cache directory. The cap is the node's own pacer: here it
   emulates a home uplink per source on a loopback that has none. One more row serves from one
   source with no cap (loopback, unpaced). Printed per row: megabytes, seconds (the lookup of
   sources included), MB/s of the transfer, its ratio to one capped source, and each source's share.

2. Joining, with real processes (shardnet.testing.localswarm): a ~1.0e9-parameter random llama
   checkpoint in bfloat16 (written once under ``--join-root`` and reused) is served whole by one
   peer (``shardnet join --model DIR --layers 0:N``); then ``shardnet join --model NAME --layers
   0:N/2 --cache-dir <fresh>`` is started and timed from its start to its "serving" event: its
   fetch (bytes, MB/s, from its "fetch" events) and the rest (start-up, loading, measuring its
   throughput). The span of the first half also brings the embedding (span_tensor_names). Printed before it: how long ``shardnet model manifest DIR`` takes with no
   manifest cache (hashing every chunk, as the full peer does the first time) and with it.
   ``--quick`` uses a small model here and a small checkpoint in part 1 (for tests).

Progress goes to stderr; the tables to stdout.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import trio

from bench._common import bench_parser, print_table, progress
from shardnet.inference.model.checkpoint import MANIFEST_CACHE, Checkpoint
from shardnet.inference.model.random_model import init_random
from shardnet.inference.weights.fetcher import find_sources
from shardnet.inference.weights.server import WeightServer
from shardnet.inference.weights.swarm_model import (
    fetch_tensors,
    open_from_swarm,
    span_tensor_names,
)
from shardnet.testing.helpers import loopback_config
from shardnet.testing.localswarm import LocalSwarm, shardnet_argv
from shardnet.transport import open_node
from shardnet.transport.limits import Limits

#: "no cap": far above what loopback carries, so the pacer never waits
UNCAPPED_MB_PER_S = 1e9
#: the ~1.0e9-parameter checkpoint of part 2 (TinyLlama's shape with 20 layers: 1.012e9 parameters)
JOIN_MODEL = {"layers": 20, "hidden": 2048, "heads": 32, "kv_heads": 4, "intermediate": 5632, "vocab": 32000}
QUICK_JOIN_MODEL = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 1024, "vocab": 1024}


# -- 1. sources side by side (one process) --------------------------------------------------------
@dataclass
class FetchRow:
    label: str
    sources: int
    cap: float | None  # MB/s per source; None: no cap
    megabytes: float = 0.0
    seconds: float = 0.0  # the whole fetch_tensors call: looking the sources up, then the transfer
    rate: float = 0.0  # MB/s of the transfer (FetchProgress.rate)
    shares: list[float] = field(default_factory=list)  # each source's part of the bytes, largest first


async def fetch_span(model: Path, sources: int, cap_mb_per_s: float, cache_root: Path) -> tuple[int, float, float,
                                                                                                list[float]]:
    """A fresh swarm of ``sources`` nodes serving ``model`` at ``cap_mb_per_s`` each; every layer
    fetched into ``cache_root``: (bytes, seconds, transfer bytes/s, shares)."""
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config()))
        bootstrap = [str(boot.listen_addrs[0])]
        ckpt = Checkpoint(model)
        for _ in range(sources):
            node = await stack.enter_async_context(open_node(loopback_config(
                bootstrap=bootstrap, limits=Limits(weights_mb_per_s=cap_mb_per_s))))
            await node.wait_bootstrapped()
            server = await node.add_behaviour(WeightServer(node))
            server.add(ckpt)
        fetching = await stack.enter_async_context(open_node(loopback_config(bootstrap=bootstrap)))
        await fetching.wait_bootstrapped()
        # every source findable (each publishes 0.5-2 s after it starts)
        with trio.fail_after(30):
            while len(await find_sources(fetching, ckpt.model_id, timeout=5)) < sources:
                await trio.sleep(0.2)
        path, _card = await open_from_swarm(fetching, model.name, cache_root=cache_root)  # manifest, files
        fetched = Checkpoint(path)
        names = span_tensor_names(fetched, 0, fetched.num_layers)
        t0 = time.perf_counter()
        report = await fetch_tensors(fetching, fetched, names)
        seconds = time.perf_counter() - t0
        want = sum(fetched.catalog[n].size for n in names)
        if report is None or report.bad or report.done != want:
            raise SystemExit(f"error: the fetch from {sources} sources brought "
                             f"{0 if report is None else report.done} of {want} bytes")
        if len(report.per_source) != sources:
            progress(f"  note: {len(report.per_source)} of {sources} sources sent chunks")
        shares = sorted((b / report.done for b in report.per_source.values()), reverse=True)
        return report.done, seconds, report.rate, shares


def run_sources(args, tmp: Path) -> list[FetchRow]:
    model = tmp / "bench-weights"
    progress(f"part 1: writing a random checkpoint ({args.layers} layers, hidden {args.hidden}, {args.dtype}) ...")
    init_random(model, "llama", layers=args.layers, hidden=args.hidden, heads=8, kv_heads=2,
                intermediate=args.hidden * 11 // 4, vocab=1024, seed=3, dtype=args.dtype)
    rows = [FetchRow(f"{n} source{'s' if n > 1 else ''}", n, args.uplink_mb_per_s) for n in args.sources]
    rows.append(FetchRow("1 source, no cap", 1, None))
    for k, row in enumerate(rows):
        progress(f"part 1: fetching span 0:{args.layers} from {row.label} ...")
        done, row.seconds, rate, row.shares = trio.run(
            fetch_span, model, row.sources, row.cap or UNCAPPED_MB_PER_S, tmp / f"cache-{k}")
        row.megabytes, row.rate = done / 1e6, rate / 1e6
    return rows


def print_sources(rows: list[FetchRow], args) -> None:
    base = next(r.rate for r in rows if r.sources == 1 and r.cap is not None)
    print_table(
        f"Fetching span 0:{args.layers} (every layer and the head parts) of a random checkpoint "
        f"({rows[0].megabytes:.0f} MB), real hosts on loopback in one process.\nEach source serves the whole "
        f"checkpoint, paced at {args.uplink_mb_per_s:g} MB/s (weights_mb_per_s: emulates a home uplink; loopback has none);\nthe last row is unpaced. "
        "s: the fetch, source lookup included; MB/s: the transfer; ratio: to 1 capped source.",
        ["sources", "cap MB/s", "MB", "s", "MB/s", "ratio", "share per source"],
        [[r.label, f"{r.cap:g}" if r.cap is not None else "none", f"{r.megabytes:.1f}", f"{r.seconds:.2f}",
          f"{r.rate:.1f}", f"{r.rate / base:.2f}", "/".join(f"{s * 100:.0f}" for s in r.shares) + " %"] for r in rows],
        notes=True)


# -- 2. a joining peer, real processes ----------------------------------------------------------
def shardnet_cli(*args: str, timeout: float = 1800) -> float:
    """Run ``shardnet ARGS`` (this interpreter's); its wall time in seconds."""
    t0 = time.perf_counter()
    r = subprocess.run(shardnet_argv(*args), capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode != 0:
        raise SystemExit(f"error: shardnet {' '.join(args)} failed: {r.stderr.strip()[-500:]}")
    return time.perf_counter() - t0


def join_model(root: Path, dims: dict, name: str) -> tuple[Path, float | None]:
    """The checkpoint of part 2 under ``root`` (written once, then reused) and how long writing
    it took now (None: reused). Written next to it and renamed, so a half-written one is never used."""
    path = root / name
    if (path / "config.json").is_file():
        return path, None
    partial = root / f".partial-{name}"
    shutil.rmtree(partial, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    progress(f"part 2: writing {path} (once; reused after) ...")
    seconds = shardnet_cli("model", "init-random", str(partial), "--family", "llama",
                           *(a for k, v in dims.items() for a in (f"--{k.replace('_', '-')}", str(v))),
                           "--dtype", "bfloat16", "--seed", "1")
    partial.rename(path)
    return path, seconds


@dataclass
class JoinRun:
    params: int = 0
    model_mb: float = 0.0
    wrote_s: float | None = None
    hash_s: float = 0.0  # `shardnet model manifest` with no manifest cache
    cached_s: float = 0.0  # the same with it (the start-up and reading the cache)
    full_serving_s: float = 0.0
    join_serving_s: float = 0.0
    first_fetch_s: float = 0.0  # from the start to its first fetch event
    fetch_end_s: float = 0.0  # ... to its last fetch event (every byte of the span here)
    fetched_mb: float = 0.0
    span_mb: float = 0.0  # what span_tensor_names says the joiner's span is
    fetch_rate: float = 0.0  # MB/s, the layers' transfer as the joiner's fetch events report it
    num_layers: int = 0
    layers: tuple[int, int] = (0, 0)


def run_join(args) -> JoinRun:
    dims = QUICK_JOIN_MODEL if args.quick else JOIN_MODEL
    name = "bench-llama-quick" if args.quick else "bench-llama-1b"
    out = JoinRun()
    model, out.wrote_s = join_model(Path(args.join_root), dims, name)
    ckpt = Checkpoint(model)
    out.params = sum(e.size for e in ckpt.entries.values()) // 2  # bfloat16
    out.model_mb = ckpt.total_bytes / 1e6
    n = out.num_layers = ckpt.num_layers
    a, b = out.layers = (0, n // 2)
    out.span_mb = sum(ckpt.catalog[t].size for t in span_tensor_names(ckpt, a, b)) / 1e6

    progress("part 2: timing `shardnet model manifest` without and with its cache ...")
    (model / MANIFEST_CACHE).unlink(missing_ok=True)
    out.hash_s = shardnet_cli("model", "manifest", str(model))
    out.cached_s = shardnet_cli("model", "manifest", str(model))

    # the joiner asks the swarm for NAME; no Hugging Face hub probe first (a name is also a repo
    # ID): that would time this machine's internet, not the swarm
    env_before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        with tempfile.TemporaryDirectory(prefix="shardnet-bench-join-") as work, LocalSwarm(Path(work)) as swarm:
            swarm.start_bootstrap()
            limit = ("--limit", f"weights_mb_per_s={args.join_uplink_mb_per_s:g}") if args.join_uplink_mb_per_s else ()
            progress(f"part 2: the full peer loads {model} ({n} layers) ...")
            t0 = time.monotonic()
            full = swarm.spawn_node("full", "--model", str(model), "--layers", f"0:{n}", *limit, command="join")
            full.wait_event(lambda e: e.get("event") == "serving", timeout=args.timeout)
            out.full_serving_s = time.monotonic() - t0
            time.sleep(1.0)  # its card and provider records out
            progress(f"part 2: a peer joins with --model {name} --layers {a}:{b} ...")
            t0 = time.monotonic()
            joiner = swarm.spawn_node("joiner", "--model", name, "--layers", f"{a}:{b}",
                                      "--cache-dir", str(Path(work) / "cache"), command="join")
            fetch_events = []

            def serving(ev: dict) -> bool:
                if ev.get("event") == "fetch":
                    fetch_events.append((time.monotonic() - t0, ev))
                return ev.get("event") == "serving"

            joiner.wait_event(serving, timeout=args.timeout)
            out.join_serving_s = time.monotonic() - t0
    finally:
        if env_before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = env_before
    if not fetch_events:
        raise SystemExit("error: the joining peer reported no fetch (did it find the weights locally?)")
    out.first_fetch_s = fetch_events[0][0]
    out.fetch_end_s = fetch_events[-1][0]
    last = {}
    for _, ev in fetch_events:
        last[ev["what"]] = ev
    out.fetched_mb = sum(ev["done"] for ev in last.values()) / 1e6
    if "layers" in last:
        out.fetch_rate = last["layers"]["rate"] / 1e6
    return out


def print_join(j: JoinRun, args) -> None:
    a, b = j.layers
    uplink = f"{args.join_uplink_mb_per_s:g} MB/s" if args.join_uplink_mb_per_s else "its default weights_mb_per_s"
    print(f"\nA peer joining with `shardnet join --model NAME --layers {a}:{b} --cache-dir <fresh>` (processes on "
          f"loopback):\nrandom llama, {j.params / 1e9:.3f}e9 parameters, bfloat16, {j.model_mb:.0f} MB; one full "
          f"peer serves it all at {uplink}." + ("" if j.wrote_s is None else f" Written in {j.wrote_s:.1f} s."))
    rows = [
        ("shardnet model manifest, no cache (hashes every chunk)", f"{j.hash_s:.2f} s"),
        ("shardnet model manifest, cached", f"{j.cached_s:.2f} s"),
        ("  so hashing the manifest the first time takes about", f"{j.hash_s - j.cached_s:.2f} s"),
        (f"full peer: start to serving (layers 0:{j.num_layers})", f"{j.full_serving_s:.1f} s"),
        ("joiner: start to its first fetch event", f"{j.first_fetch_s:.1f} s"),
        ("joiner: start to its last fetch event (span here)", f"{j.fetch_end_s:.1f} s"),
        (f"joiner: its span (layers {a}:{b} and the embedding)", f"{j.span_mb:.1f} MB"),
        ("joiner: bytes fetched (files and span)", f"{j.fetched_mb:.1f} MB"),
        ("joiner: layers' transfer rate (its fetch events)", f"{j.fetch_rate:.1f} MB/s"),
        ("joiner: start to serving", f"{j.join_serving_s:.1f} s"),
        ("joiner: bytes fetched / start to serving", f"{j.fetched_mb / j.join_serving_s:.1f} MB/s"),
    ]
    for label, value in rows:
        print(f"{label:56}{value:>12}", flush=True)


def main() -> None:
    ap = bench_parser(__doc__, quick="small models in both parts (for tests)")
    ap.add_argument("--uplink-mb-per-s", type=float, default=25.0,
                    help="part 1: each source's weights_mb_per_s (a home uplink), MB/s")
    ap.add_argument("--sources", default="1,2,4", help="part 1: source counts, capped")
    ap.add_argument("--layers", type=int, default=8, help="part 1: the checkpoint's layers")
    ap.add_argument("--hidden", type=int, default=1024, help="part 1: the checkpoint's hidden size")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="part 1: its dtype")
    ap.add_argument("--join-root", default="/tmp/shardnet-bench-1b",
                    help="part 2: where its checkpoint is written once and reused")
    ap.add_argument("--join-uplink-mb-per-s", type=float, default=None,
                    help="part 2: the full peer's weights_mb_per_s (default: the node's default)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="part 2: seconds to wait for each peer to serve")
    ap.add_argument("--skip-join", action="store_true", help="part 1 only")
    args = ap.parse_args()
    args.sources = [int(s) for s in args.sources.split(",")]
    if 1 not in args.sources:
        ap.error("--sources must include 1 (the ratios are to it)")
    if args.quick:
        args.layers, args.hidden, args.dtype = 4, 256, "float32"
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="shardnet-bench-weights-") as tmp:
        print_sources(run_sources(args, Path(tmp)), args)
    if not args.skip_join:
        print_join(run_join(args), args)


if __name__ == "__main__":
    main()
