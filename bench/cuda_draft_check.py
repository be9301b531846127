"""Device check for the CUDA-graphed draft: same tokens as eager execution, and how much faster.

    python bench/cuda_draft_check.py [--steps 200] [--k 6]

Needs a CUDA device. For the shipped draft and for a larger random llama (a draft of a size
where kernel launches no longer dominate), drafts k tokens at a time from a text that grows the
way verification makes it grow (a few drafts kept, then a token the draft did not expect, so
the static cache rolls back under the graph every call), three ways: eager on the CPU, eager on
CUDA, graphed on CUDA. Prints whether all three proposed identical tokens at every call and the
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


def check(name: str, path: Path, steps: int, k: int) -> bool:
    cpu = ModelDrafter(path)
    eager = ModelDrafter(path, device="cuda", cuda_graph=False)
    graphed = ModelDrafter(path, device="cuda", cuda_graph=True)
    vocab = cpu.decoder.model.config.vocab_size
    texts = texts_for(cpu, steps, k, vocab, seed=7)
    run(eager, texts[:5], k), run(graphed, texts[:5], k)  # warm-up
    got_cpu, t_cpu = run(cpu, texts, k)
    got_eager, t_eager = run(eager, texts, k)
    got_graph, t_graph = run(graphed, texts, k)
    same_eager = sum(a == b for a, b in zip(got_graph, got_eager))
    same_cpu = sum(a == b for a, b in zip(got_graph, got_cpu))
    print(f"{name}: {steps} proposals of k={k}, each after a rollback")
    print(f"  graphed == eager CUDA: {same_eager}/{steps} calls identical")
    print(f"  graphed == eager CPU:  {same_cpu}/{steps} calls identical")
    print(f"  per drafted token: CPU {t_cpu * 1e3:.3f} ms, CUDA eager {t_eager * 1e3:.3f} ms, "
          f"CUDA graph {t_graph * 1e3:.3f} ms ({t_eager / t_graph:.2f}x eager)")
    return same_eager == steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--k", type=int, default=6)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = check("shipped tiny-llama-draft", default_draft_path(), args.steps, args.k)
    with tempfile.TemporaryDirectory() as d:
        big = init_random(Path(d) / "llama-160m", "llama", layers=8, hidden=1024, heads=16, kv_heads=4,
                          vocab=2048, seed=3)
        ok = check("random llama, 8 layers, hidden 1024", big, args.steps, args.k) and ok
    if not ok:
        sys.exit("error: the graphed draft proposed different tokens than eager execution")


if __name__ == "__main__":
    main()
