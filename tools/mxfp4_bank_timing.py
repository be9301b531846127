"""Per-token time of one gpt-oss expert bank held as MXFP4 (dequantized per call, one expert at a
time) against the same bank held dense, on this machine's CPU.

``--tokens`` tokens (1: a decode step), each routed to the same ``--active`` experts, run through
``gate_up_proj`` (hidden x 2*intermediate per expert) the way transformers' grouped_mm experts
implementation runs them (``torch._grouped_mm`` over the bank); the time is per token.
Defaults are gpt-oss-20b's per-expert shape (hidden 2880, intermediate 2880, 4 active experts)
with a bank of those 4 experts (the time depends on the active experts, not the bank's size).

    python tools/mxfp4_bank_timing.py [--hidden 2880 --intermediate 2880 --active 4 --tokens 1 --reps 10]
"""

from __future__ import annotations

import argparse
import time

import torch

from shardnet.inference.model.mxfp4 import to_stored
from shardnet.inference.model.stored import stored_nbytes
from shardnet.testing.mxfp4 import quantize_mxfp4


def per_call_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--intermediate", type=int, default=2880)
    ap.add_argument("--active", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    dense_f32 = torch.randn(args.active, args.hidden, 2 * args.intermediate) * 0.02  # [E, H, 2I], as gpt-oss
    blocks, scales = quantize_mxfp4(dense_f32.mT)
    name = "mlp.experts.gate_up_proj"
    offs = torch.arange(1, args.active + 1, dtype=torch.int32) * args.tokens  # each token to every expert
    print(f"bank [{args.active}, {args.hidden}, {2 * args.intermediate}], {args.tokens} token(s) to "
          f"{args.active} experts, {torch.get_num_threads()} threads, best of {args.reps}")
    for dtype in (torch.bfloat16, torch.float32):
        stored = to_stored({name + "_blocks": blocks, name + "_scales": scales}, {}, dtype)[name]
        dense = stored.dequantize()
        x = torch.randn(args.active * args.tokens, args.hidden, dtype=dtype)
        assert torch.equal(torch._grouped_mm(x, stored, offs=offs), torch._grouped_mm(x, dense, offs=offs))
        with torch.inference_mode():
            t_stored = per_call_ms(lambda: torch._grouped_mm(x, stored, offs=offs), args.reps) / args.tokens
            t_dense = per_call_ms(lambda: torch._grouped_mm(x, dense, offs=offs), args.reps) / args.tokens
        print(f"{str(dtype)[6:]:>9}: MXFP4 {stored_nbytes(stored) / 2**20:6.1f} MiB {t_stored:8.2f} ms/token | "
              f"dense {stored_nbytes(dense) / 2**20:6.1f} MiB {t_dense:8.2f} ms/token | x{t_stored / t_dense:.1f}")


if __name__ == "__main__":
    main()
