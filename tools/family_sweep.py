"""Every causal LM family of the installed transformers, through shardnet's split, against transformers.

    python tools/family_sweep.py [--families llama,olmoe] [--json out.json] [--markdown]

For each model_type in transformers' causal-LM registry: ``init_random`` (the code behind
``shardnet model init-random``) writes a tiny random checkpoint (6 layers, hidden 64, a sliding
window of 5 where the family has one, few small experts); shardnet loads it as a client and two
peers would (the family check of the head and of each span's layer kinds, then a head and
blocks 0:3 and 3:6 in this process) and decodes greedily after a 12-token prompt; transformers
(``from_pretrained``, float32) decodes the same. Each family ends in one of:

- ``identical``: shardnet runs it and its greedy tokens equal transformers';
- ``refused``: shardnet refuses it in one line (the reason is printed);
- ``not constructible``: no random checkpoint of it can be made at test size here (the reason);
- ``DIFFERS``: shardnet runs it and its tokens differ. There must be none: the exit status is 1.

Rows go to stdout as they finish, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardnet.errors import ShardnetError  # noqa: E402
from shardnet.testing.helpers import transformers_reference  # noqa: E402

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 5, 301, 23, 8]
NEW_TOKENS = 10
LAYERS = 6
#: a random checkpoint above this many parameters is not made (a multimodal tower, defaults
#: that ignore the common size names)
MAX_PARAMS = 60_000_000


def registry() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def recorded(models_md: Path = Path(__file__).resolve().parent.parent / "docs" / "models.md"
             ) -> dict[str, tuple[str, str]]:
    """The sweep docs/models.md records: {model_type: (outcome, reason)}."""
    text = models_md.read_text()
    table = text.split("<!-- family-sweep:begin -->")[1].split("<!-- family-sweep:end -->")[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        family, outcome, reason = (c.strip() for c in line.strip().strip("|").split("|"))
        rows[family] = outcome, reason
    return rows


def _one_line(e: BaseException) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:160]


def make(family: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from shardnet.inference.model.random_model import init_random, make_config

    cfg = make_config(family, layers=LAYERS, hidden=64, heads=4, kv_heads=2, intermediate=None, vocab=512)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n / 1e6:.0f}M parameters at test size (its config ignores the common size names)")
    return init_random(out, family, layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=512, seed=1)


def shardnet_tokens(path: Path) -> list[int]:
    """Greedy tokens as a client with the head and two peers (0:3, 3:6) compute them, each
    having passed the family check for what it holds."""
    from shardnet.inference.model.block import Block, Head
    from shardnet.inference.model.checkpoint import Checkpoint
    from shardnet.inference.model.family_check import ensure_family_matches

    ckpt = Checkpoint(path)
    spans = [(0, LAYERS // 2), (LAYERS // 2, LAYERS)]
    ensure_family_matches(ckpt)  # the client: the head
    for span in spans:  # each peer: its span's layer kinds
        ensure_family_matches(ckpt, span, head=False)
    head = Head(ckpt)
    blocks = [Block(ckpt, *span) for span in spans]
    caches = [b.new_cache() for b in blocks]
    ids, pos, out = torch.tensor([PROMPT]), 0, []
    for _ in range(NEW_TOKENS):
        h = head.embed(ids)
        for block, cache in zip(blocks, caches):
            h = block.forward(h, cache, pos)
        pos += ids.shape[1]
        out.append(int(head.logits(h)[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


def sweep_one(family: str) -> tuple[str, str]:
    """(outcome, detail) for one model_type."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = make(family, Path(tmp) / family)
        except ShardnetError as e:
            return "refused", _one_line(e)
        except Exception as e:  # noqa: BLE001 - any failure to make one is the outcome
            return "not constructible", _one_line(e)
        try:
            got = shardnet_tokens(path)
        except ShardnetError as e:
            return "refused", _one_line(e)
        try:
            want = transformers_reference(path, PROMPT, NEW_TOKENS)[0]
        except Exception as e:  # noqa: BLE001
            return "not constructible", f"transformers cannot run it: {_one_line(e)}"
        if got != want:
            first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            return "DIFFERS", f"from token {first + 1}: {got} vs transformers {want}"
        return "identical", ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", help="comma-separated model_types (default: the whole registry)")
    ap.add_argument("--json", type=Path, help="also write {model_type: [outcome, detail]} here")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown (docs/models.md)")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    families = args.families.split(",") if args.families else registry()
    results: dict[str, tuple[str, str]] = {}
    if args.markdown:
        print("| model_type | outcome | reason |\n|---|---|---|", flush=True)
    for n, family in enumerate(families, 1):
        t0 = time.perf_counter()
        outcome, detail = sweep_one(family)
        results[family] = outcome, detail
        print(f"[{n}/{len(families)}] {family}: {outcome} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        if args.markdown:
            print(f"| {family} | {outcome} | {detail.replace('|', '/')} |", flush=True)
        else:
            print(f"{family:28}{outcome:20}{detail}", flush=True)
    counts = {o: sum(1 for r in results.values() if r[0] == o)
              for o in ("identical", "refused", "not constructible", "DIFFERS")}
    print(", ".join(f"{v} {k}" for k, v in counts.items()), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True))
    return 1 if counts["DIFFERS"] else 0


if __name__ == "__main__":
    sys.exit(main())
