"""Tolerance-aware verification without a network: the decision on synthetic logits, and
`shardnet verify --recompute`'s check on a run of the shipped tiny-llama served in float16 with
every step batched (as a compute peer batches concurrent sessions), honest and perturbed."""

import base64

import pytest
import torch
from libp2p.peer.id import ID

from shardnet.inference.client.recompute import recompute_check
from shardnet.inference.model.block import Block, Head
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.tolerance import LOGIT_TOLERANCE, check_tokens, logit_tolerance
from shardnet.models import default_model_path
from shardnet.protocols import receipts as rc
from shardnet.transport import identity


def row(best: float, token_logit: float, vocab: int = 16) -> torch.Tensor:
    """Logits whose best is ``best`` (token 0) and token 1's is ``token_logit``; the rest lower."""
    r = torch.full((vocab,), -best)
    r[0], r[1] = best, token_logit
    return r


def test_a_near_tie_within_the_tolerance_passes_and_reports_its_margin():
    logits = torch.stack([row(10.0, 5.0), row(10.0, 10.0 - 0.02), row(10.0, 3.0)])
    v = check_tokens(logits, [0, 1, 0], LOGIT_TOLERANCE["float16"])  # token 1 is 0.2 % below the best
    assert v.ok and v.worst == 1 and v.not_argmax == 1
    assert v.gap == pytest.approx(0.002, rel=1e-3) and v.margin == pytest.approx(LOGIT_TOLERANCE["float16"] - 0.002, abs=1e-6)
    assert "smallest margin" in v.describe() and "token 1" in v.describe()


def test_a_token_one_percent_below_the_best_fails_in_float16_and_float32():
    logits = torch.stack([row(10.0, 5.0), row(10.0, 10.0 * 0.99)])
    for dtype in ("float16", "float32"):
        v = check_tokens(logits, [0, 1], logit_tolerance(dtype))
        assert not v.ok and v.worst == 1 and v.margin < 0
        assert "beyond the tolerance" in v.describe()
    # bfloat16 rounds coarser: 1 % is within its honest noise
    assert check_tokens(logits, [0, 1], logit_tolerance("bfloat16")).ok


def test_exact_mode_requires_the_argmax():
    logits = torch.stack([row(10.0, 5.0), row(10.0, 9.999)])
    assert check_tokens(logits, [0, 0], 0.0, exact=True).ok
    v = check_tokens(logits, [0, 1], 0.0, exact=True)
    assert not v.ok and v.worst == 1 and "not the recomputed argmax" in v.describe()


def test_the_widest_dtype_sets_the_tolerance_and_unknown_counts_as_bfloat16():
    assert logit_tolerance("float32") < logit_tolerance("float16") < logit_tolerance("bfloat16") < 0.1
    assert logit_tolerance("float32", "float16", None) == logit_tolerance("bfloat16")  # an older receipt
    assert logit_tolerance("float16", "int8q") == LOGIT_TOLERANCE["int8q"]
    assert logit_tolerance("float16") < 0.01  # a 1 % error is caught in float16
    with pytest.raises(ValueError, match="rows of logits"):
        check_tokens(torch.zeros(2, 4), [0], 0.1)


# -- the recompute check on a served run -----------------------------------------------------------

PROMPTS = [[5, 17, 300, 41, 9], [1, 2, 3], [100, 200, 300, 400, 500, 600, 700], [42, 42]]
SPANS = [(0, 4), (4, 8)]


@torch.inference_mode()
def serve_batched(perturb: float = 0.0, tokens: int = 12) -> list[list[int]]:
    """Greedy text for every prompt, their steps computed together in one ``forward_batch`` per
    span in float16; ``perturb`` scales the first span's outputs by (1 + perturb), as a cheater would."""
    ckpt = Checkpoint(default_model_path())
    blocks = [Block(ckpt, a, b, dtype=torch.float16) for a, b in SPANS]
    head = Head(ckpt, dtype=torch.float16)
    caches = [[b.new_cache() for b in blocks] for _ in PROMPTS]
    texts = [list(p) for p in PROMPTS]
    feed = [head.embed(torch.tensor([p])) for p in PROMPTS]
    for _ in range(tokens):
        for k, block in enumerate(blocks):
            feed = block.forward_batch([(h, caches[s][k]) for s, h in enumerate(feed)])
            if k == 0 and perturb:
                feed = [h * (1 + perturb) for h in feed]
        for s in range(len(PROMPTS)):
            texts[s].append(int(head.logits(feed[s][:, -1:])[0, -1].argmax()))
        feed = [head.embed(torch.tensor([[t[-1]]])) for t in texts]
    return [t[len(p):] for t, p in zip(texts, PROMPTS)]


def receipt(prompt: list[int], output: list[int], *, dtypes: bool = True) -> dict:
    """A run receipt's document as ``recompute_check`` reads it (stage receipts signed, as verify_run
    requires before it; the run signature is not what is tested here)."""
    ckpt = Checkpoint(default_model_path())
    stages = []
    for a, b in SPANS:
        key = identity.generate()
        extra = dict(dtype="float16", quant="none", batched_steps=len(output)) if dtypes else {}
        st = rc.StageReceipt(model=ckpt.model_id, session="00" * 16, layers=[a, b], in_chain=rc.ZERO,
                             out_chain=rc.ZERO, steps_in=len(output), steps_out=len(output), t_start=0.0, t_end=1.0,
                             peer=str(ID.from_pubkey(key.public_key)), observed={}, device={"kind": "cpu"},
                             version="test", **extra)
        stages.append(base64.b64encode(rc.encode_stage(key, st)).decode())
    body = {"model": ckpt.model_id, "prompt_sha256": rc.tokens_hash(prompt), "output_ids": output,
            "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0}, "seed": None, "wire": None,
            "sessions": [{"session": "00" * 16, "stages": stages}]}
    if dtypes:
        body["dtype"] = "float16"
    return {"body": body, "prompt_ids": prompt}


@pytest.fixture(scope="module")
def honest():
    return serve_batched()


def test_a_float16_batched_honest_run_verifies_teacher_forced(honest):
    for prompt, out in zip(PROMPTS, honest):
        c = recompute_check(receipt(prompt, out), default_model_path())
        assert c.ok, c.detail
        assert "teacher-forced" in c.detail and "smallest margin" in c.detail and "0:4 float16" in c.detail
    # an older receipt (no dtypes recorded) verifies too, under the widest tolerance, and says so
    old = recompute_check(receipt(PROMPTS[0], honest[0], dtypes=False), default_model_path())
    assert old.ok and "older receipt" in old.detail


def test_a_token_one_percent_below_the_best_is_caught(honest):
    """A token served where the recomputed best is 1 % (of the largest |logit|) or more above it
    is caught: beyond float16's tolerance. (The tiny model's nearest such token is about 2 % below.)"""
    ckpt = Checkpoint(default_model_path())
    prompt, out = PROMPTS[2], list(honest[2])
    blocks = [Block(ckpt, a, b, dtype=torch.float16) for a, b in SPANS]
    head = Head(ckpt, dtype=torch.float16)
    with torch.inference_mode():
        h = head.embed(torch.tensor([prompt + out[:-1]]))
        for b in blocks:
            h = b.forward(h, b.new_cache(), 0)
        logits = head.logits(h)[0, len(prompt) - 1:]
    # the token closest to its position's best from at least 1 % below takes that position
    rel = (logits.amax(-1, keepdim=True) - logits) / logits.abs().amax(-1, keepdim=True)
    over = torch.where(rel >= 0.01, rel, torch.inf)
    pos, token = divmod(int(over.argmin()), over.shape[1])
    assert float(over.min()) < 0.03
    out[pos] = token
    c = recompute_check(receipt(prompt, out), default_model_path())
    assert not c.ok and f"token {pos} is" in c.detail and "beyond the tolerance" in c.detail, c.detail
    # --exact regenerates the text and names the same token
    exact = recompute_check(receipt(prompt, out), default_model_path(), exact=True)
    assert not exact.ok and f"token {pos} differs" in exact.detail
