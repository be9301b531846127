"""Device check for the CUDA-graphed draft: same tokens as eager execution, and how much faster.

    python bench/cuda_draft_check.py [--steps 200] [--k 6] [--cpu-only] [--quick]

Needs a CUDA device (``--cpu-only``: the CPU rows alone, the CUDA ones read "not available").
For the shipped draft and for a larger random llama (a draft of a size where kernel launches
no longer dominate), drafts k tokens at a time from a text that grows the way verification
makes it grow (a few drafts kept, then a token the draft did not expect, so the static cache
rolls back under the graph every call), three ways: eager on the CPU, eager on CUDA, graphed
on CUDA. Prints whether all three proposed identical tokens at every call and the
time per drafted token, and exits non-zero if any token differed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardnet.inference.model.random_model import init_random  # noqa: E402
from shardnet.inference.client.speculative import ModelDrafter  # noqa: E402
from shardnet.models import default_draft_path  # noqa: E402


def run(drafter: ModelDrafter, texts: list[list[int]], k: int) -> tuple[list[list[int]], float]:
    out = []
    if drafter.decoder.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ids in texts:
        out.append(drafter.propose(ids, k))
    return out, (time.perf_counter() - t0) / (len(texts) * k)


def texts_for(drafter: ModelDrafter, steps: int, k: int, vocab: int, seed: int) -> list[list[int]]:
    """The texts a verification loop would hand the drafter: keep some drafts, add a surprise."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (24,), generator=gen).tolist()
    texts = []
    for step in range(steps):
        texts.append(list(ids))
        drafts = drafter.propose(ids, k)
        ids = ids + drafts[:step % (k + 1)] + [int(torch.randint(1, vocab, (), generator=gen))]
    return texts


def check(name: str, path: Path, steps: int, k: int, cuda: bool) -> bool:
    """Prints the three ways' agreement and speed; without ``cuda``, the CPU's alone (the CUDA
    rows read "not available"). False if the graphed draft proposed other tokens than eager CUDA."""
    cpu = ModelDrafter(path)
    vocab = cpu.decoder.model.config.vocab_size
    texts = texts_for(cpu, steps, k, vocab, seed=7)
    got_cpu, t_cpu = run(cpu, texts, k)
    print(f"{name}: {steps} proposals of k={k}, each after a rollback")
    if not cuda:
        print("  graphed == eager CUDA: cuda not available")
        print("  graphed == eager CPU:  cuda not available")
        print(f"  per drafted token: CPU {t_cpu * 1e3:.3f} ms, CUDA eager not available, CUDA graph not available")
        return True
    eager = ModelDrafter(path, device="cuda", cuda_graph=False)
    graphed = ModelDrafter(path, device="cuda", cuda_graph=True)
    run(eager, texts[:5], k), run(graphed, texts[:5], k)  # warm-up
    got_eager, t_eager = run(eager, texts, k)
    got_graph, t_graph = run(graphed, texts, k)
    same_eager = sum(a == b for a, b in zip(got_graph, got_eager))
    same_cpu = sum(a == b for a, b in zip(got_graph, got_cpu))
    print(f"  graphed == eager CUDA: {same_eager}/{steps} calls identical")
    print(f"  graphed == eager CPU:  {same_cpu}/{steps} calls identical")
    print(f"  per drafted token: CPU {t_cpu * 1e3:.3f} ms, CUDA eager {t_eager * 1e3:.3f} ms, "
          f"CUDA graph {t_graph * 1e3:.3f} ms ({t_eager / t_graph:.2f}x eager)")
    return same_eager == steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--cpu-only", action="store_true",
                   help="no CUDA device needed: the CPU rows alone, the CUDA ones read 'not available'")
    p.add_argument("--quick", action="store_true",
                   help="a short run for the tests: 5 proposals of k=3, the larger draft at hidden 256")
    args = p.parse_args()
    layers, hidden, heads = 8, 1024, 16
    if args.quick:
        args.steps, args.k = 5, 3
        layers, hidden, heads = 2, 256, 4
    cuda = torch.cuda.is_available() and not args.cpu_only
    if not cuda and not args.cpu_only:
        sys.exit("error: no CUDA device (--cpu-only runs the CPU rows alone)")
    device = torch.cuda.get_device_name() if cuda else "cuda not available, CPU rows only"
    print(f"device: {device}, torch {torch.__version__}")
    ok = check("shipped tiny-llama-draft", default_draft_path(), args.steps, args.k, cuda)
    with tempfile.TemporaryDirectory() as d:
        big = init_random(Path(d) / "llama", "llama", layers=layers, hidden=hidden, heads=heads, kv_heads=4,
                          vocab=2048, seed=3)
        ok = check(f"random llama, {layers} layers, hidden {hidden}", big, args.steps, args.k, cuda) and ok
    if not ok:
        sys.exit("error: the graphed draft proposed different tokens than eager execution")


if __name__ == "__main__":
    main()
