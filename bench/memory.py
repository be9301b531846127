"""A peer's memory holding a checkpoint in its stored format: RSS against the bytes its span stores.

    python -m bench.memory [--models llama,qwen3_moe,gpt_oss] [--formats none,fp8,int8,int4,...] [--hidden 2048]
                           [--layers 8] [--tokens 16] [--kv-budget-mb 64] [--quick]

For each model (random checkpoints made here: a dense llama of width ``--hidden``; a qwen3_moe
and a gpt_oss of half that width, 8 experts each, whose experts are quantized with the rest) and
each format it is measured in (``MODEL_FORMATS``), a 2-peer chain of real ``shardnet join`` processes
(layers split in half, one torch thread each) serves the checkpoint, and for each peer the report
gives, measured from ``/proc/PID/status``:

- ``stored MiB``: the bytes its span's tensors take as the peer holds them (placement's
  ``layer_bytes``: stored low-bit parts at their size, the rest in the compute dtype);
- ``RSS MiB``: its resident memory once loaded and ready (``VmRSS``), and ``peak MiB`` while it
  loaded (``VmHWM`` at that moment), with ``peak/RSS``;
- ``bound MiB``: the issue's bound, 1.15 x (stored + KV budget) + baseline, where the baseline is
  the RSS of a peer of the same build serving one layer of the shipped tiny model (the runtime:
  Python, torch, transformers, libp2p); the KV budget is reserved per session when one opens, so
  a freshly loaded peer holds none of it;
- ``ms/token``: a client in this process generates ``--tokens`` tokens greedily through the
  chain; the mean time per token after the first, and its ratio to the ``none`` row of the same
  model: the unquantized checkpoint in the compute dtype, which is what a peer that dequantized
  the format at load would compute with (same shapes, dense weights).

Formats: ``none`` (the checkpoint as made, bfloat16), ``int8``/``int4`` (``join --quantize``:
torchao, quantized at load from the bfloat16 checkpoint), and every stored format that
``shardnet model init-random --format`` writes (``STORED_FORMAT_WRITERS``: a copy of the same
bfloat16 checkpoint in that format, with its reference quantizer).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import trio

from bench._common import bench_parser, print_table, ratio
from shardnet.cli.model import STORED_FORMAT_WRITERS, stored_format_writer
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.random_model import init_random
from shardnet.inference.server.placement import layer_bytes
from shardnet.models import default_model_path
from shardnet.testing.localswarm import LocalSwarm

MiB = 1 << 20
QUANTIZE_MODES = ("int8", "int4")
#: the formats each model is measured in (--formats picks among them): GGUF is read for llama
#: only, MXFP4 is gpt-oss's
MODEL_FORMATS = {
    "llama": ("none", "int8", "int4", "fp8", "gptq", "awq", "compressed-tensors", "gguf-q8_0", "gguf-q4_k"),
    "qwen3_moe": ("none", "int8", "int4", "fp8", "gptq", "compressed-tensors"),
    "gpt_oss": ("none", "int4", "mxfp4"),
}


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def make_model(family: str, workdir: Path, hidden: int, layers: int) -> Path:
    """A random bfloat16 checkpoint: a dense llama of width ``hidden``; the MoE families at half
    that width with 8 experts of that width (2 a token)."""
    kw = dict(layers=layers, hidden=hidden, heads=max(1, hidden // 64), kv_heads=max(1, hidden // 256),
              vocab=2048, dtype="bfloat16", seed=1)
    if family == "llama":
        kw["intermediate"] = hidden * 8 // 3 // 64 * 64
    else:
        half = max(64, hidden // 2)
        kw.update(hidden=half, heads=max(1, half // 64), kv_heads=max(1, half // 256), intermediate=half,
                  experts=8, active_experts=2)
    path = init_random(workdir / family, family, **kw)
    shutil.copy(default_model_path() / "tokenizer.json", path / "tokenizer.json")  # every ID a token
    return path


def checkpoint_for(plain: Path, fmt: str, workdir: Path) -> tuple[Path, list[str]]:
    """The checkpoint directory a format's peers serve, and their extra ``join`` arguments."""
    if fmt == "none":
        return plain, []
    if fmt in QUANTIZE_MODES:
        return plain, ["--quantize", fmt]
    out = stored_format_writer(fmt)(plain, workdir / f"{plain.name}-{fmt}")
    if (plain / "tokenizer.json").is_file() and Path(out).is_dir():
        shutil.copy(plain / "tokenizer.json", Path(out) / "tokenizer.json")
    return Path(out), []


def baseline_rss(swarm: LocalSwarm) -> int:
    p = swarm.spawn_node("baseline", "--layers", "0:1", "--threads", "1", "--kv-budget-mb", "1", command="join")
    swarm.wait_ready(p, 120)
    rss = proc_status(p.pid)["VmRSS"]
    p.stop()
    return rss


async def per_token_ms(swarm: LocalSwarm, path: Path, tokens: int) -> float:
    from shardnet.inference.client.client import Client
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.testing.helpers import loopback_config
    from shardnet.transport import open_node

    async with open_node(loopback_config(bootstrap=[swarm.bootstrap_addr], dht_mode="client")) as node:
        await node.wait_bootstrapped()
        client = Client(node, LocalModel(path, dtype="bfloat16"), audit_rate=0.0)  # (the peers' dtype)
        times = []
        last = None
        async for _ in client.generate(list(range(1, 17)), max_new_tokens=tokens, stop_at_eos=False):
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            last = now
        return statistics.mean(times) * 1e3


def measure(family: str, fmt: str, path: Path, extra: list[str], args, baseline: int, workdir: Path) -> list[dict]:
    ckpt = Checkpoint(path)
    half = ckpt.num_layers // 2
    spans = [(0, half), (half, ckpt.num_layers)]
    quantize = extra[1] if extra else None
    with LocalSwarm(workdir / f"swarm-{family}-{fmt}") as swarm:
        swarm.start_bootstrap()
        procs = [swarm.spawn_node(f"p{a}", "--model", str(path), "--layers", f"{a}:{b}", "--threads", "1",
                                  "--dtype", "bfloat16", "--kv-budget-mb", str(args.kv_budget_mb), *extra,
                                  command="join") for a, b in spans]
        for p in procs:
            swarm.wait_ready(p, 600)
        loaded = [proc_status(p.pid) for p in procs]
        ms = trio.run(per_token_ms, swarm, path, args.tokens)
    rows = []
    for (a, b), status in zip(spans, loaded):
        stored = sum(layer_bytes(ckpt, i, "bfloat16", quantize) for i in range(a, b))
        bound = 1.15 * (stored + args.kv_budget_mb * MiB) + baseline
        rows.append(dict(model=family, fmt=fmt, span=f"{a}:{b}", stored=stored, rss=status["VmRSS"],
                         peak=status["VmHWM"], bound=bound, ms=ms))
    return rows


def main() -> None:
    p = bench_parser(__doc__, quick="a tiny llama (hidden 128, 2 layers) in none, fp8 and int4, 2 tokens")
    p.add_argument("--models", default=",".join(MODEL_FORMATS))
    p.add_argument("--formats", default=",".join(["none", "int8", "int4", *STORED_FORMAT_WRITERS]),
                   help="none, int8, int4 (join --quantize) and the stored formats: "
                        + ", ".join(STORED_FORMAT_WRITERS))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--kv-budget-mb", type=int, default=64)
    args = p.parse_args()
    if args.quick:
        args.models, args.formats, args.hidden, args.layers, args.tokens = "llama", "none,fp8,int4", 128, 2, 3
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in ("none", *QUANTIZE_MODES, *STORED_FORMAT_WRITERS)]
    if unknown:
        raise SystemExit(f"error: unknown format {unknown[0]!r}")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        with LocalSwarm(workdir / "baseline") as swarm:
            swarm.start_bootstrap()
            baseline = baseline_rss(swarm)
        for family in args.models.split(","):
            plain = make_model(family, workdir, args.hidden, args.layers)
            for fmt in formats:
                if fmt not in MODEL_FORMATS.get(family, formats):
                    continue
                print(f"{family} {fmt}: loading", flush=True)
                path, extra = checkpoint_for(plain, fmt, workdir)
                rows += measure(family, fmt, path, extra, args, baseline, workdir)
    print(f"\nrandom {args.models} of hidden {args.hidden}, {args.layers} layers, bfloat16 compute, 2 peers "
          f"(`shardnet join --threads 1 --kv-budget-mb {args.kv_budget_mb}`); baseline (a peer serving one layer of "
          f"the shipped tiny model): {baseline / MiB:.0f} MiB")
    none_ms = {r["model"]: r["ms"] for r in rows if r["fmt"] == "none"}
    table = []
    for r in rows:
        ok = r["rss"] <= r["bound"] and r["peak"] <= 1.3 * r["rss"]
        table.append([r["model"], r["fmt"], r["span"], f"{r['stored'] / MiB:.1f}", f"{r['rss'] / MiB:.0f}",
                      f"{r['peak'] / MiB:.0f}", f"{r['peak'] / r['rss']:.2f}", f"{r['bound'] / MiB:.0f}",
                      f"{r['ms']:.1f}", ratio(r["ms"], none_ms.get(r["model"])),
                      "meets" if ok else "misses"])
    print_table("target: RSS <= 1.15 x (stored + KV budget) + baseline, peak <= 1.3 x RSS",
                ["model", "format", "span", "stored MiB", "RSS MiB", "peak MiB", "peak/RSS", "bound MiB",
                 "ms/token", "x none", "target"], table, left=3)


if __name__ == "__main__":
    main()
