"""One block's cost per decode step, batched vs one session at a time, side by side in one run.

    python -m bench.batched_block [--sessions 1,4,16,64] [--context 32] [--rounds 10] [--threads 2] [--quick]

N sessions, each with ``--context`` tokens cached, take one decode step each: once as N forward
passes (the old one-at-a-time path), once as one ``Block.forward_batch``. Prints ms per round of
steps, the speedup, and the fit c(b) = c0 + b * c_tok that docs/performance.md uses for batched
serving. The block: all 8 layers of the shipped tiny-llama, in float32.
"""

from __future__ import annotations

import time

import torch

from bench._common import bench_parser, print_table, ratio  # noqa: E402
from shardnet.inference.model.block import Block  # noqa: E402
from shardnet.inference.model.checkpoint import Checkpoint  # noqa: E402
from shardnet.models import default_model_path  # noqa: E402


def main() -> None:
    ap = bench_parser(__doc__, quick="a short run for the tests: 1 and 4 sessions, 2 rounds, 1 thread")
    ap.add_argument("--sessions", default="1,4,16,64")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.context, args.rounds, args.threads = "1,4", 8, 2, 1
    torch.set_num_threads(args.threads)
    ckpt = Checkpoint(default_model_path())
    block = Block(ckpt, 0, ckpt.num_layers, dtype=torch.float32)
    width = block.config.hidden_size

    def primed(n):
        caches = [block.new_cache() for _ in range(n)]
        for c in caches:
            block.forward(torch.randn(1, args.context, width), c, 0)
        return caches

    def best(fn, caches) -> float:
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            fn(caches)
            times.append(time.perf_counter() - t0)
        return min(times) * 1000

    def one_at_a_time(caches):
        for c in caches:
            block.forward(torch.randn(1, 1, width), c, c.get_seq_length())

    def batched(caches):
        block.forward_batch([(torch.randn(1, 1, width), c) for c in caches])

    rows, table = [], []
    for n in [int(x) for x in args.sessions.split(",")]:
        alone, together = best(one_at_a_time, primed(n)), best(batched, primed(n))
        rows.append((n, together))
        table.append([n, f"{alone:.2f}", f"{together:.2f}", ratio(alone, together), f"{n / together * 1000:.0f}"])
    print_table(f"one decode step of each of N sessions ({args.context} tokens cached), all {ckpt.num_layers} layers "
                f"of tiny-llama, float32, {args.threads} threads; best of {args.rounds} rounds",
                ["N", "one at a time ms", "batched ms", "speedup", "batched tok/s"], table, left=0)
    if len(rows) >= 2:
        (n0, c0), (n1, c1) = rows[0], rows[-1]
        tok = (c1 - c0) / (n1 - n0)
        print(f"fit: c(b) = {c0 - n0 * tok:.2f} ms + b * {tok:.3f} ms")


if __name__ == "__main__":
    main()
