"""One block's cost per decode step, batched vs one session at a time, side by side in one run.

    python -m bench.batched_block [--sessions 1,4,16] [--context 32,2048,8192] [--hidden 2048]
                                  [--rounds 5] [--threads 2] [--quick]

N sessions, each with ``--context`` positions cached, take one decode step each: once as N forward
passes (one at a time), once as one ``Block.forward_batch``. Prints ms per round of steps, the
speedup, and per context the fit c(b) = c0 + b * c_tok that docs/performance.md uses for batched
serving. The block: all 8 layers of the shipped tiny-llama in float32, or with ``--hidden N`` the
first 4 of the 8 layers of the random llama of that width that bench.concurrent_decode uses (one
peer's block of its 2-peer chain; float32 here). Caches are filled with random keys and values
(what they hold does not change a step's cost) in the session caches a peer allocates
(``Block.new_cache(max_len)``). The comparison with the path before issue 35's KV cache in
docs/benchmarks.md was run with a ``--concat-path`` flag removed after that run (``git show
93e723f:bench/batched_block.py``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from bench._common import bench_parser, print_table
from shardnet.inference.model.block import Block
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.kv_cache import SlabLayer
from shardnet.models import default_model_path

#: decode steps each session may still take after its context (the caches' max_len): the rounds
#: and a warm-up
HEADROOM = 64


def random_llama(root: Path, hidden: int) -> Path:
    from shardnet.inference.model.random_model import init_random

    return init_random(root / f"llama-{hidden}", "llama", layers=8, hidden=hidden, heads=hidden // 64,
                       kv_heads=max(1, hidden // 256), intermediate=hidden * 8 // 3 // 64 * 64, vocab=512,
                       dtype="float32", seed=1)


def filled_pool_cache(block: Block, context: int):
    cache = block.new_cache(context + HEADROOM)
    for layer in cache.layers:
        if isinstance(layer, SlabLayer):
            (hk, dk), (hv, dv) = layer.shape.key, layer.shape.value
            layer.write(torch.randn(1, hk, context, dk, dtype=block.dtype),
                        torch.randn(1, hv, context, dv, dtype=block.dtype))
    return cache


def main() -> None:
    ap = bench_parser(__doc__, quick="a short run for the tests: 1 and 4 sessions at 8 and 40 positions, "
                                     "2 rounds, 1 thread")
    ap.add_argument("--sessions", default="1,4,16")
    ap.add_argument("--context", default="32,2048,8192", help="positions cached per session (comma-separated)")
    ap.add_argument("--hidden", type=int, default=None, metavar="N",
                    help="the 8-layer random llama of this width (its first 4 layers), not tiny-llama")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not 1 <= args.rounds < HEADROOM:
        ap.error(f"--rounds must be 1 to {HEADROOM - 1}")
    if args.quick:
        args.sessions, args.context, args.rounds, args.threads = "1,4", "8,40", 2, 1
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.hidden:
            ckpt = Checkpoint(random_llama(Path(tmp), args.hidden))
            block, name = Block(ckpt, 0, 4), f"layers 0:4 of the 8-layer random llama of width {args.hidden}"
        else:
            ckpt = Checkpoint(default_model_path())
            block, name = Block(ckpt, 0, ckpt.num_layers), f"all {ckpt.num_layers} layers of tiny-llama"
        run(block, name, args)


def run(block: Block, name: str, args) -> None:
    width = block.config.hidden_size
    step = torch.randn(1, 1, width)

    def best(fn, caches) -> float:
        fn(caches)  # warm-up (first touches of the caches' memory, thread pools)
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            fn(caches)
            times.append(time.perf_counter() - t0)
        return min(times) * 1000

    def one_at_a_time(caches):
        for c in caches:
            block.forward(step, c, c.get_seq_length())

    def batched(caches):
        block.forward_batch([(step, c) for c in caches])

    print(f"one decode step of each of N sessions, {name}, float32, {args.threads} threads; "
          f"best of {args.rounds} rounds (ms per round of N steps)")
    header = ["context", "N", "one at a time", "batched", "speedup", "batched tok/s"]
    rows, fits = [], []
    for context in [int(x) for x in args.context.split(",")]:
        points = []
        for n in [int(x) for x in args.sessions.split(",")]:
            alone = best(one_at_a_time, [filled_pool_cache(block, context) for _ in range(n)])
            together = best(batched, [filled_pool_cache(block, context) for _ in range(n)])
            points.append((n, together))
            row = [context, n, f"{alone:.2f}", f"{together:.2f}", f"{alone / together:.2f}x",
                   f"{n / together * 1000:.0f}"]
            rows.append(row)
        if len(points) >= 2:
            (n0, c0), (n1, c1) = points[0], points[-1]
            tok = (c1 - c0) / (n1 - n0)
            fits.append(f"context {context}: c(b) = {c0 - n0 * tok:.2f} ms + b * {tok:.3f} ms")
    print_table(None, header, rows)
    for fit in fits:
        print("fit:", fit)


if __name__ == "__main__":
    main()
