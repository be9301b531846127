"""How often a draft model's greedy choice agrees with the target's, on the target's own output.

    python -m bench.draft_agreement [--draft PATH ...] [--tokens 96] [--quick]

For six code prompts the target (the shipped tiny-llama) continues greedily; then, at every
position of those continuations, the draft's argmax is compared with the target's (teacher
forcing: both see the same text). This per-token agreement is the acceptance rate greedy
speculative decoding gets from the draft (docs/performance.md). The n-gram drafter's agreement
is shown too, over the positions where it proposes anything. Then the suffix drafter's chains
against its trees (``SuffixDrafter.propose_tree``), teacher-forced over wan_decode's eight prompts
of three kinds, and the draft model's chains against its trees (``ModelDrafter.propose_tree``: its
chain and its second choices beside it): tokens per traversal greedy speculation would get, drafts
sent and drafting time per traversal.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench._common import bench_parser  # noqa: E402
from shardnet.inference.model.local_model import LocalModel  # noqa: E402
from shardnet.inference.client.speculative import NGramDrafter  # noqa: E402
from shardnet.models import default_draft_path, default_model_path  # noqa: E402
from shardnet.testing.helpers import transformers_generate, transformers_model  # noqa: E402

PROMPTS = ["def __init__(self, name):\n        self.name = name\n        self.",
           "import os\nimport sys\n\ndef main():\n    ", "class Parser:\n    def parse(self, text):\n        ",
           "    for i in range(len(items)):\n        if ", '"""Return the number of', "    except ValueError:\n        "]


def main() -> None:
    p = bench_parser(__doc__, quick="a short run for the tests: 2 prompts x 8 tokens")
    p.add_argument("--draft", type=Path, action="append", help="draft checkpoint(s) (default: the shipped one)")
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args()
    prompts = PROMPTS
    if args.quick:
        prompts, args.tokens = PROMPTS[:2], 8
    model = LocalModel(default_model_path())
    target = transformers_model(str(default_model_path()), "float32")
    texts = []
    for prompt in prompts:
        ids = model.encode(prompt)
        out = transformers_generate(target, torch.tensor([ids]), args.tokens)[0]
        with torch.inference_mode():
            texts.append((len(ids), out, target(out[None]).logits[0].argmax(-1)))
    for path in args.draft or [default_draft_path()]:
        draft = transformers_model(str(path), "float32")
        agree = total = 0
        with torch.inference_mode():
            for n_prompt, out, want in texts:
                got = draft(out[None]).logits[0].argmax(-1)
                span = slice(n_prompt - 1, len(out) - 1)  # predictions of the generated tokens
                agree += int((got[span] == want[span]).sum())
                total += span.stop - span.start
        print(f"{path}: greedy agreement with the target {agree / total:.1%} over {total} positions")
    ngram, proposed, right = NGramDrafter(), 0, 0
    for n_prompt, out, _ in texts:
        seq = out.tolist()
        for i in range(n_prompt, len(seq)):
            guess = ngram.propose(seq[:i], 1)
            if guess:
                proposed += 1
                right += guess[0] == seq[i]
    print(f"n-gram drafter: proposes at {proposed} positions, right at {right / max(1, proposed):.1%} of them")
    suffix_trees(model, target, args)


def suffix_trees(model, target, args) -> None:
    """Chains against trees, teacher-forced: over wan_decode's prompts of three kinds, the target's
    greedy continuation is decoded as greedy speculation would decode it (each traversal keeps the
    longest drafted path the target agrees with, plus its own next token), and tokens per
    traversal, drafts sent and drafting time per traversal are counted, for the suffix drafter
    and the draft model. A projection of what tree verification gains, not a run through peers."""
    import time

    from bench.wan_decode import PROMPTS as MIXED
    from shardnet.inference.client.speculative import ModelDrafter, accept_greedy_tree
    from shardnet.inference.client.suffix_drafter import SuffixDrafter

    mixed = MIXED[:2] if args.quick else MIXED
    texts = []
    for _, prompt in mixed:
        ids = model.encode(prompt)
        out = transformers_generate(target, torch.tensor([ids]), args.tokens)[0].tolist()
        texts.append((ids, out[len(ids):]))
    draft = ModelDrafter(default_draft_path(), vocab_size=model.ckpt.config.vocab_size)
    # (drafter, shape, size: drafts in a chain or tree, or the draft's chain k, branches beside it)
    shapes = [("suffix", "chain", 8, None), ("suffix", "tree", 8, None), ("suffix", "tree", 16, None),
              ("suffix", "tree", 32, None), ("draft", "chain", 6, None), ("draft", "chain", 8, None),
              ("draft", "chain", 12, None), ("draft", "tree", 6, 6), ("draft", "tree", 8, 8)]
    print(f"over {len(mixed)} prompts ({', '.join(sorted({k for k, _ in mixed}))}) x {args.tokens} target tokens, "
          "teacher-forced: tokens per traversal (drafts sent, drafting ms per traversal)")
    for who, kind, size, branches in shapes:
        traversals = sent = 0
        t_draft = 0.0
        for ids, cont in texts:
            drafter, p = (SuffixDrafter() if who == "suffix" else draft), 0
            if who != "suffix":
                draft.forget()
            while p < len(cont):
                text = ids + cont[:p]
                t0 = time.perf_counter()
                if kind == "chain":
                    tokens = drafter.propose(text, size)
                    parents = list(range(-1, len(tokens) - 1))
                elif who == "suffix":
                    tokens, parents = drafter.propose_tree(text, size)
                else:
                    tokens, parents = drafter.propose_tree(text, size, branches)
                t_draft += time.perf_counter() - t0
                depths: list[int] = []
                for q in parents:
                    depths.append(0 if q < 0 else depths[q] + 1)
                # the target's token after each draft, where the path to it is the target's own text
                after = [cont[p]] + [cont[p + d + 1] if p + d + 1 < len(cont) else -1 for d in depths]
                path, _ = accept_greedy_tree(tokens, parents, after)
                p += len(path) + 1
                traversals += 1
                sent += len(tokens)
        total = sum(len(c) for _, c in texts)
        shape = f"{kind} of {size:>2}" if branches is None else f"tree of {size} + {branches:>2}"
        print(f"  {who:<6} {shape:<12}: {total / traversals:.2f} tokens per traversal "
              f"({sent / traversals:.1f} drafts, {1e3 * t_draft / traversals:.1f} ms drafting)")
    shared_outputs(texts)


def shared_outputs(texts) -> None:
    """The suffix drafter's chain of 8 with a gateway's shared outputs (``serve --share-outputs``:
    a ``SuffixCache``): holding the other prompts' answers (other users asking other things), and
    holding an earlier answer to the same prompt (a repeated request), teacher-forced as above."""
    from shardnet.inference.client.speculative import accept_greedy
    from shardnet.inference.client.suffix_drafter import SuffixCache, SuffixDrafter

    print("  suffix chain of 8 drafting from a gateway's shared outputs too (serve --share-outputs):")
    for name in ("the other prompts' answers", "an earlier answer to the same prompt"):
        traversals = 0
        for i, (ids, cont) in enumerate(texts):
            cache = SuffixCache()
            for j, (_, other) in enumerate(texts):
                if (j != i) == (name != "an earlier answer to the same prompt"):
                    cache.add(other)
            drafter, p = SuffixDrafter(cache=cache), 0
            while p < len(cont):
                drafts = drafter.propose(ids + cont[:p], 8)
                want = cont[p:p + len(drafts) + 1]  # the target's token after the text and each draft
                p += len(accept_greedy(drafts, want + [-1] * (len(drafts) + 1 - len(want))))
                traversals += 1
        print(f"    {name}: {sum(len(c) for _, c in texts) / traversals:.2f} tokens per traversal")

if __name__ == "__main__":
    main()
