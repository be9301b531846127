"""Several sessions' steps as one forward pass (``Block.forward_batch``, issue 23's foundation):
sessions of different lengths, prefill chunks next to single decode positions and verify-sized
chunks, a session joining late, one leaving early, a rollback; every step's output equals the
session's output run alone, in every family that differs in attention (sliding windows, soft-caps,
sinks, MLA, experts)."""

import random

import pytest
import torch

from shardnet.inference.model.block import Block, Head
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.random_model import init_random

FAMILIES = ["llama", "mistral", "gemma2", "qwen3_moe", "deepseek_v3", "gpt_oss"]
TOL = 1e-4


def schedule(seed: int, sessions: int = 5, steps: int = 6):
    """Per session: the step it joins at, then what it feeds at each step (token IDs; None: it
    sits this step out; an int: roll its cache back by that many tokens first, then feed)."""
    rng = random.Random(seed)
    plan = []
    for s in range(sessions):
        join = 0 if s < 3 else rng.randint(1, 3)
        feeds = {join: [rng.randrange(1, 300) for _ in range(rng.randint(2, 9))]}  # a prompt
        for step in range(join + 1, steps):
            if s == 1 and step == steps - 2:
                break  # leaves early
            if rng.random() < 0.2:
                continue  # not ready this step
            feeds[step] = [rng.randrange(1, 300) for _ in range(rng.choice([1, 1, 1, 3, 4]))]
        plan.append(feeds)
    rollback = {(0, 3): 2}  # session 0 rolls back 2 tokens before its step 3 (rejected drafts)
    return plan, rollback


def run(block, head, plan, rollback, steps, batched: bool):
    caches = [block.new_cache() for _ in plan]
    out = {}
    for step in range(steps):
        ready = []
        for s, feeds in enumerate(plan):
            if step in feeds:
                if (s, step) in rollback:
                    caches[s].crop(-rollback[(s, step)])
                ready.append((s, head.embed(torch.tensor([feeds[step]]))))
        if not ready:
            continue
        if batched:
            results = block.forward_batch([(h, caches[s]) for s, h in ready])
        else:
            results = [block.forward(h, caches[s], caches[s].get_seq_length()) for s, h in ready]
        for (s, _), r in zip(ready, results):
            out[(s, step)] = head.logits(r)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_sessions_computes_what_each_computes_alone(tmp_path, family):
    extra = {"experts": 4, "active_experts": 2} if family in ("qwen3_moe", "deepseek_v3", "gpt_oss") else {}
    if family == "mistral":
        extra["sliding_window"] = 5  # shorter than the longer sessions
    path = init_random(tmp_path / family, family, layers=3, hidden=64, heads=4, kv_heads=2, vocab=300, seed=2,
                       **extra)
    ckpt = Checkpoint(path)
    block, head = Block(ckpt, 0, ckpt.num_layers), Head(ckpt)
    steps = 7
    plan, rollback = schedule(seed=len(family), steps=steps)
    alone = run(block, head, plan, rollback, steps, batched=False)
    together = run(block, head, plan, rollback, steps, batched=True)
    assert alone.keys() == together.keys() and len(alone) > 10
    for key in alone:
        diff = (alone[key] - together[key]).abs().max().item()
        assert diff <= TOL, (key, diff)
        assert torch.equal(alone[key].argmax(-1), together[key].argmax(-1)), key


def test_sliding_windows_shorter_than_the_sessions_are_applied_per_row(tmp_path):
    """Mistral with a window of 4: rows of different lengths each see only their own last 4."""
    path = init_random(tmp_path / "m", "mistral", layers=2, hidden=64, heads=4, kv_heads=2, vocab=300, seed=3,
                       sliding_window=4)
    ckpt = Checkpoint(path)
    assert ckpt.raw_config["sliding_window"] == 4
    block, head = Block(ckpt, 0, 2), Head(ckpt)
    plan = [{0: list(range(1, 12)), 1: [5], 2: [6, 7]}, {0: [3, 4], 1: [9, 10, 11], 2: [12]}]
    alone = run(block, head, plan, {}, 3, batched=False)
    together = run(block, head, plan, {}, 3, batched=True)
    for key in alone:
        assert (alone[key] - together[key]).abs().max().item() <= TOL, key
