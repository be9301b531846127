"""Every supported family: a 2-peer chain vs transformers in one process, side by side.

    python -m bench.families [--hidden 256] [--tokens 24] [--families llama,mixtral]

For each family in ``shardnet.inference.model.families.FAMILIES`` that is tested in CI, a random
checkpoint (4 layers, ``--hidden``) is written; transformers generates ``--tokens`` greedy tokens
in this process, and a client generates them through two peers (layers 0:2 and 2:4, real
py-libp2p hosts on loopback in this process). Printed per family: decode tokens/s of each
(prefill excluded on both sides: transformers' time for one token is subtracted), their ratio,
and whether the greedy tokens are identical. All transformers runs come before the first chain
(peers leave threads behind in the process). Progress goes to stderr.
"""

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

from shardnet.inference.client.client import Client  # noqa: E402
from shardnet.inference.model.families import FAMILIES  # noqa: E402
from shardnet.inference.model.local_model import LocalModel  # noqa: E402
from shardnet.inference.model.random_model import init_random  # noqa: E402
from shardnet.testing.helpers import (  # noqa: E402
    local_chain,
    loopback_config,
    transformers_generate,
    transformers_model,
)

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 5, 301]


def transformers_decode(path: Path, new: int) -> tuple[list[int], float]:
    """Greedy tokens and decode tokens/s (the time for ``new`` tokens less that for one)."""
    model = transformers_model(path)
    ids = torch.tensor([PROMPT])

    def run(n: int):
        t0 = time.perf_counter()
        out = transformers_generate(model, ids, n)
        return out[0, len(PROMPT):].tolist(), time.perf_counter() - t0

    run(2)  # warm-up
    _, one = run(1)
    tokens, total = run(new)
    return tokens, (new - 1) / max(total - one, 1e-9)


async def two_peer_decode(path: Path, new: int) -> tuple[list[int], float]:
    """Greedy tokens and decode tokens/s through two peers (from the client's own stats)."""
    async with local_chain(loopback_config, path, [(0, 2), (2, 4)]) as node:
        client = Client(node, LocalModel(path), audit_rate=0)  # the chain alone
        [t async for t in client.generate(PROMPT, max_new_tokens=2, stop_at_eos=False)]  # warm-up
        tokens = [t.id async for t in client.generate(PROMPT, max_new_tokens=new, stop_at_eos=False)]
        stats = client.last_stats  # its first token comes from the prefill, as transformers' does
        return tokens, (stats.new_tokens - 1) / max(stats.decode_s, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--families", default=",".join(f for f, fam in FAMILIES.items() if fam.tested))
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    print(f"{'family':14}{'MoE':>5}{'transformers tok/s':>20}{'2-peer chain tok/s':>20}{'chain/hf':>10}"
          f"{'greedy match':>14}")
    families = args.families.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        # every transformers run first: a chain leaves hosts and worker threads in this process
        # that would slow the single-process runs after it
        reference = {}
        for family in families:
            print(f"{family}: writing a random checkpoint, decoding with transformers ...", file=sys.stderr)
            path = init_random(Path(tmp) / family, family, layers=4, hidden=args.hidden, heads=4, kv_heads=2,
                               vocab=512, seed=1)
            reference[family] = path, *transformers_decode(path, args.tokens)
        for family in families:
            print(f"{family}: decoding through two peers ...", file=sys.stderr)
            path, want, hf = reference[family]
            got, chain = trio.run(two_peer_decode, path, args.tokens)
            print(f"{family:14}{'yes' if FAMILIES[family].moe else '':>5}{hf:>20.1f}{chain:>20.1f}"
                  f"{chain / hf:>10.2f}{'yes' if got == want else 'NO':>14}", flush=True)


if __name__ == "__main__":
    main()
