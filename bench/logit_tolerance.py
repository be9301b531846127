"""How far honest computations of the same text differ, by dtype: what verification tolerates.

    python -m bench.logit_tolerance [--sessions 8] [--tokens 24] [--seeds 3] [--dtypes float32,float16,bfloat16]

The shipped tiny-llama split as the swarm serves it (layers 0:4 and 4:8). ``--sessions``
sessions with random prompts (4 to 24 tokens) decode ``--tokens`` tokens greedily, every step of
every session computed together in one ``Block.forward_batch`` per block (continuous batching,
as a compute peer runs concurrent sessions). Then, per dtype, two honest re-computations:

- **verify** (``shardnet verify --recompute``): prompt + output teacher-forced through the whole
  model in one forward pass. Reported: the largest difference of any logit at any position,
  relative to the position's largest |logit|; how often the served token is not the recomputed
  argmax; and the largest *gap* of a served token below the recomputed best, relative likewise
  (what the tolerant check compares with ``VERIFY_TOLERANCE``).
- **audit** (a witness re-running one step): the block's output for a sampled step after a
  one-pass prefill of the session's earlier inputs, against the batched output; ``divergence``
  as ``audit.divergence`` computes it (what ``audit.TOLERANCE`` bounds).

Runs on the CPU (or ``--device``); float16 on a CPU is computed by torch's CPU kernels, which
need not round like a GPU's.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from bench._common import print_table
from shardnet.inference.client.audit import divergence  # noqa: E402
from shardnet.inference.model.block import DTYPES, Block, Head  # noqa: E402
from shardnet.inference.model.checkpoint import Checkpoint  # noqa: E402
from shardnet.models import default_model_path  # noqa: E402


def relative(diff: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return diff / logits.abs().amax(-1).clamp_min(1e-6)


@torch.inference_mode()
def measure(ckpt: Checkpoint, dtype: torch.dtype, device: str, sessions: int, tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = ckpt.raw_config["vocab_size"]
    spans = [Block(ckpt, 0, 4, dtype=dtype, device=device), Block(ckpt, 4, ckpt.num_layers, dtype=dtype, device=device)]
    whole = Block(ckpt, 0, ckpt.num_layers, dtype=dtype, device=device)
    head = Head(ckpt, dtype=dtype, device=device)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 24))] for _ in range(sessions)]
    caches = [[b.new_cache() for b in spans] for _ in range(sessions)]
    texts = [list(p) for p in prompts]
    inputs: list[list[list[torch.Tensor]]] = [[[], []] for _ in range(sessions)]  # per session, per block
    outputs: list[list[list[torch.Tensor]]] = [[[], []] for _ in range(sessions)]
    served_logits: list[list[torch.Tensor]] = [[] for _ in range(sessions)]
    feed = [head.embed(torch.tensor([p])) for p in prompts]
    for _ in range(tokens):
        for k, block in enumerate(spans):
            outs = block.forward_batch([(h, caches[s][k]) for s, h in enumerate(feed)])
            for s in range(sessions):
                inputs[s][k].append(feed[s])
                outputs[s][k].append(outs[s])
            feed = outs
        for s in range(sessions):
            row = head.logits(feed[s][:, -1:])[0, -1]
            served_logits[s].append(row)
            texts[s].append(int(row.argmax()))
        feed = [head.embed(torch.tensor([[t[-1]]])) for t in texts]
    worst_logit = worst_gap = 0.0
    flips = positions = 0
    for s in range(sessions):
        n = len(prompts[s])
        ids = torch.tensor([texts[s][:-1]])
        local = head.logits(whole.forward(head.embed(ids), whole.new_cache(), 0))[0, n - 1:]
        served = torch.stack(served_logits[s])
        worst_logit = max(worst_logit, float(relative((local - served).abs().amax(-1), local).max()))
        chosen = torch.tensor(texts[s][n:])
        gap = relative(local.amax(-1) - local.gather(-1, chosen[:, None])[:, 0], local)
        worst_gap = max(worst_gap, float(gap.max()))
        flips += int((local.argmax(-1) != chosen).sum())
        positions += len(chosen)
    worst_audit = 0.0
    for s in range(sessions):
        for k, block in enumerate(spans):
            for step in range(1, tokens, 4):
                cache = block.new_cache()
                prefix = torch.cat(inputs[s][k][:step], dim=1)
                block.forward(prefix, cache, 0)
                again = block.forward(inputs[s][k][step], cache, prefix.shape[1])
                worst_audit = max(worst_audit, divergence(again, outputs[s][k][step]))
    return {"logit": worst_logit, "gap": worst_gap, "flips": flips, "positions": positions, "audit": worst_audit}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    ckpt = Checkpoint(default_model_path())
    table = []
    for name in args.dtypes.split(","):
        rows = [measure(ckpt, DTYPES[name], args.device, args.sessions, args.tokens, seed) for seed in range(args.seeds)]
        flips, positions = sum(r["flips"] for r in rows), sum(r["positions"] for r in rows)
        table.append([name, f"{max(r['logit'] for r in rows):.2e}", f"{max(r['gap'] for r in rows):.2e}",
                      f"{flips}/{positions}", f"{max(r['audit'] for r in rows):.2e}"])
    print_table(f"tiny-llama, {args.sessions} sessions batched x {args.tokens} tokens x {args.seeds} seeds, "
                f"{args.device}",
                ["dtype", "max rel logit diff", "max rel gap", "argmax flips", "max audit div"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
