"""Distilling a draft model from a target, for speculative decoding (``shardnet model
distill-draft``; tools/train_default_model.py made the shipped tiny-llama-draft this way).

A draft pays only where the target agrees with it, so it is trained to match the target's
next-token distributions (KL(target || draft)), on corpus windows and, alternately, on the
target's own continuations of corpus snippets (half greedy, half sampled at temperature 0.8):
what the draft is asked to predict at decode time is the target's output. ``distill_draft``
starts the draft as the target's first layers with its embeddings, final norm and LM head (the
same tokenizer, the same vocabulary, a useful start), then trains it; it runs on any causal LM
transformers loads, on CPU in float32, and costs a target forward per step: sized for small
targets here.
"""

from __future__ import annotations

import copy
import math
import random
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch

SEED = 1234
#: tokens per training window, and windows per batch
SEQ = 128
BATCH = 32


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def stdlib_corpus() -> str:
    """The top-level modules of the running interpreter's standard library: always present, offline."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def batches(ids: torch.Tensor, steps: int, rng: random.Random, *, seq: int = SEQ, batch: int = BATCH):
    n = len(ids) - seq - 1
    if n <= 0:
        raise ValueError(f"corpus of {len(ids)} tokens: at least {seq + 2} needed for windows of {seq + 1}")
    for _ in range(steps):
        starts = [rng.randrange(n) for _ in range(batch)]
        yield torch.stack([ids[s:s + seq + 1] for s in starts])


def fit(model, steps: int, batch_loss: Callable[[int], torch.Tensor], name: str, metric: str, lr: float = 3e-3,
        log: Callable[[str], None] = _stderr) -> float:
    """AdamW with linear warm-up and cosine decay to 10 %, gradient clipping, a smoothed loss
    logged every 20 steps; ``batch_loss(step)`` returns the loss of that step's batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    t0, loss_avg = time.time(), None
    for step in range(1, steps + 1):
        warm = min(1.0, step / 30)
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        loss = batch_loss(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        if step % 20 == 0 or step == steps:
            log(f"[{name}] step {step}/{steps} {metric} {loss_avg:.3f} ({time.time() - t0:.0f} s)")
    model.eval()
    return loss_avg


@torch.no_grad()
def teacher_continuations(teacher, ids: torch.Tensor, n: int, rng: random.Random, *, seq: int = SEQ,
                          log: Callable[[str], None] = _stderr) -> torch.Tensor:
    """``n`` sequences of ``seq`` + 1 tokens: a 16-token corpus snippet continued by the teacher,
    half greedily, half sampled at temperature 0.8 (seeded)."""
    prompt_len, out = 16, []
    gen = torch.Generator().manual_seed(SEED)
    for first in range(0, n, 64):
        starts = [rng.randrange(len(ids) - prompt_len) for _ in range(min(64, n - first))]
        tokens = torch.stack([ids[s:s + prompt_len] for s in starts])
        sampled = torch.arange(len(starts)) % 2 == 1
        res = teacher(input_ids=tokens, use_cache=True)
        cache, logits = res.cache, res.logits[:, -1]
        while tokens.shape[1] < seq + 1:
            greedy = logits.argmax(-1)
            drawn = torch.multinomial(torch.softmax(logits.float() / 0.8, -1), 1, generator=gen)[:, 0]
            nxt = torch.where(sampled, drawn, greedy)[:, None]
            tokens = torch.cat([tokens, nxt], 1)
            res = teacher(input_ids=nxt, cache=cache, use_cache=True)
            cache, logits = res.cache, res.logits[:, -1]
        out.append(tokens)
        log(f"[distill] teacher continuations {first + len(starts)}/{n}")
    return torch.cat(out)


def distill(student, teacher, ids: torch.Tensor, steps: int, *, continuations: int = 2048, seq: int = SEQ,
            batch: int = BATCH, log: Callable[[str], None] = _stderr) -> float:
    """Train ``student`` on KL(teacher || student) over the next-token distributions; batches
    alternate between corpus windows and teacher continuations. Returns the smoothed KL."""
    rng = random.Random(SEED)
    conts = teacher_continuations(teacher, ids, continuations, rng, seq=seq, log=log) if continuations else None
    corpus = batches(ids, steps, rng, seq=seq, batch=batch)

    def batch_loss(step: int) -> torch.Tensor:
        window = next(corpus) if conts is None or step % 2 else conts[[rng.randrange(len(conts))
                                                                        for _ in range(batch)]]
        with torch.no_grad():
            target = torch.log_softmax(teacher(input_ids=window[:, :-1]).logits.float(), -1)
        pred = torch.log_softmax(student(input_ids=window[:, :-1]).logits.float(), -1)
        return torch.nn.functional.kl_div(pred.flatten(0, 1), target.flatten(0, 1), log_target=True,
                                          reduction="batchmean")

    return fit(student, steps, batch_loss, "distill", "KL", log=log)


def check_draft_depth(layers: int, target_layers: int) -> None:
    """ValueError unless a draft of ``layers`` is shallower than its target and not empty."""
    if not 1 <= layers < target_layers:
        raise ValueError(f"a draft of {layers} layer(s) from a target of {target_layers}: "
                         f"between 1 and {target_layers - 1}")


def draft_of(target, layers: int):
    """A model of the target's architecture with its first ``layers`` layers, its embeddings,
    final norm and LM head copied in."""
    from transformers import AutoModelForCausalLM

    check_draft_depth(layers, target.config.num_hidden_layers)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(config).to(torch.float32)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in draft.state_dict()}, strict=False)
    return draft


def distill_draft(target_dir: Path, out: Path, *, layers: int = 1, steps: int = 300, corpus: str | None = None,
                  continuations: int = 256, seq: int = SEQ, batch: int = 16,
                  log: Callable[[str], None] = _stderr) -> float:
    """Distill a ``layers``-layer draft from the checkpoint in ``target_dir`` and save it (with
    the target's tokenizer, in the target's stored dtype) in ``out``; the smoothed KL at the end."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_draft_depth(layers, AutoConfig.from_pretrained(str(target_dir)).num_hidden_layers)  # before loading
    torch.manual_seed(SEED)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    text = corpus if corpus is not None else stdlib_corpus()
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    log(f"[distill] corpus: {len(ids):,} tokens; target {target.config.num_hidden_layers} layers, "
        f"draft {layers}")
    draft = draft_of(target, layers)
    kl = distill(draft, target, ids, steps, continuations=continuations, seq=seq, batch=batch, log=log)
    stored = getattr(target.config, "dtype", None) or getattr(target.config, "torch_dtype", None) or torch.float32
    if isinstance(stored, str):
        stored = getattr(torch, stored)
    out.mkdir(parents=True, exist_ok=True)
    draft.to(stored).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    log(f"[distill] saved to {out} (KL {kl:.3f})")
    return kl
