"""Recompute a run receipt's output locally (``shardnet verify --recompute``).

Greedy runs are checked **teacher-forced**: the prompt and the generated tokens go through the
model in one forward pass, as the final chain served it (each stage's span in the dtype and
weight quantization its receipt records, hidden states through the run's wire dtype), and every
generated token must be within the dtypes' tolerance of the best logit at its position
(``model.tolerance``): honest peers that batched steps, or ran other kernels, round near-ties
differently, and must still verify. The check reports the smallest margin and where.

``exact=True``, and every sampled run, regenerates the text the way the client did (same seed,
same drafting) and compares token for token, as before: a sampled token depends on the whole
distribution, which the tolerance does not bound.
"""

from __future__ import annotations

import base64
from pathlib import Path

import torch
import trio

from shardnet.inference.client.sampling import SamplingParams, adjusted
from shardnet.inference.model import wire as wire_codec
from shardnet.inference.model.block import DTYPES, Block, Head
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.tolerance import check_tokens, logit_tolerance
from shardnet.protocols import receipts as rc
from shardnet.protocols.activation import QUANTIZED


def recompute_check(doc: dict, path: Path, prompt: str | None = None, *, exact: bool = False) -> rc.Check:
    """The ``recompute`` check of a (signature-checked) run receipt against the model at ``path``."""
    body = doc["body"]
    model = LocalModel(path)
    if model.model_id != body["model"]:
        return rc.Check("recompute", False, f"{path} is model {model.model_id[:16]}…, the run used {body['model'][:16]}…")
    ids = model.encode(prompt) if prompt is not None else doc.get("prompt_ids")
    if ids is None:
        return rc.Check("recompute", False, "the receipt carries no prompt tokens: give --prompt")
    if rc.tokens_hash(ids) != body["prompt_sha256"]:
        return rc.Check("recompute", False, "the prompt does not match prompt_sha256")
    params = _params(body)
    if exact or not params.greedy:
        return _replay(body, model, ids, params, exact)
    return _teacher_forced(body, model, ids, params)


def _params(body: dict) -> SamplingParams:
    sampling = body["sampling"]
    return SamplingParams(sampling["temperature"], sampling["top_p"], sampling["top_k"], body.get("seed"),
                          frequency_penalty=sampling.get("frequency_penalty", 0.0),
                          presence_penalty=sampling.get("presence_penalty", 0.0),
                          logit_bias=tuple((int(t), float(b)) for t, b in sampling.get("logit_bias", ())))


def _stages(body: dict) -> list[list[rc.StageReceipt]]:
    """Every session's stage receipts (verify_run has checked their signatures)."""
    return [[rc.decode_stage(base64.b64decode(b)) for b in s["stages"]] for s in body["sessions"]]


def run_dtypes(body: dict) -> list[str | None]:
    """The dtypes a run's numbers went through: the client's, the wire's when it set one, every
    stage's (None where a receipt does not say: an older one)."""
    stages = [st for session in _stages(body) for st in session]
    wire = [body["wire"]] if body.get("wire") else []
    return [body.get("dtype"), *wire, *(st.dtype for st in stages)]


def _teacher_forced(body: dict, model: LocalModel, ids: list[int], params: SamplingParams) -> rc.Check:
    out = [int(t) for t in body["output_ids"]]
    if not out:
        return rc.Check("recompute", True, "no generated tokens")
    final = _stages(body)[-1]
    recorded = all(st.dtype in DTYPES for st in final) and body.get("dtype") in DTYPES
    client_dtype = DTYPES[body["dtype"]] if recorded else model.dtype
    head = model.head if client_dtype == model.dtype else Head(model.ckpt, dtype=client_dtype, device=model.device)
    if recorded:  # each span as its peer computed it
        spans = [(st.layers[0], st.layers[1], DTYPES[st.dtype], None if st.quant in (None, "none") else st.quant)
                 for st in final]
    else:  # an older receipt: the whole model in the checkpoint's dtype (what peers compute in by default)
        spans = [(0, model.ckpt.num_layers, model.dtype, None)]
    wire = body.get("wire")
    with torch.inference_mode():
        hidden = head.embed(torch.tensor([ids + out[:-1]]))
        for start, end, dtype, quant in spans:
            block = Block(model.ckpt, start, end, dtype=dtype, device=model.device, quantize=quant)
            hidden = block.forward(_through_wire(hidden, wire), block.new_cache(), 0)
            del block
        logits = head.logits(hidden)[0, len(ids) - 1:]
    logits = adjusted(logits, params, [], out)  # penalties and bias, row i after out[:i]
    dtypes = run_dtypes(body)
    verdict = check_tokens(logits, out, logit_tolerance(*dtypes))
    facts = ", ".join(f"{st.layers[0]}:{st.layers[1]} {st.dtype or '?'}"
                      f"{'' if st.quant in (None, 'none') else ' ' + st.quant}"
                      f"{'' if st.batched_steps is None else f' ({st.batched_steps} steps batched)'}" for st in final)
    unknown = "" if recorded else "; dtypes not recorded (an older receipt): bfloat16's tolerance applies"
    return rc.Check("recompute", verdict.ok,
                    f"{verdict.describe()} [client {body.get('dtype') or '?'}, wire {wire or 'as computed'}, "
                    f"stages {facts}{unknown}]")


def _through_wire(hidden: torch.Tensor, wire: str | None) -> torch.Tensor:
    """``hidden`` as the next hop receives it: rounded to the session's wire dtype (int8q:
    quantized per position and back). Without one, tensors travel in the dtype they were computed in."""
    if wire is None:
        return hidden
    dtype, shape, payload = wire_codec.to_payload(hidden, wire)
    return wire_codec.decode(dtype, shape, payload) if dtype == QUANTIZED else hidden.to(DTYPES[dtype])


def _model_free_drafter(spec: dict):
    """The drafter a sampled run's receipt names, made afresh, where its drafts depend on the text
    alone (n-gram lookup, suffix matching, auto choosing between those and plain decoding: with
    sampling its choices go by counts, not timing); None for a draft model."""
    from shardnet.inference.client.auto_drafter import PLAIN, AutoDrafter
    from shardnet.inference.client.speculative import NGramDrafter
    from shardnet.inference.client.suffix_drafter import SuffixDrafter

    made = {"ngram": NGramDrafter, "suffix": SuffixDrafter}
    if spec.get("drafter") in made:
        return made[spec["drafter"]]()
    candidates = spec.get("candidates") if spec.get("drafter") == "auto" else None
    if not isinstance(candidates, list) or not candidates or not set(candidates) <= {*made, PLAIN}:
        return None
    return AutoDrafter({n: None if n == PLAIN else made[n]() for n in candidates})


def _replay(body: dict, model: LocalModel, ids: list[int], params: SamplingParams, exact: bool) -> rc.Check:
    """Regenerate the text as the client did and compare token for token."""
    from shardnet.inference.client.decode import GenerationStats, generate_on
    from shardnet.inference.client.sampling import Randomness
    from shardnet.inference.model.local_session import LocalSession

    spec = body.get("speculative")
    drafter, k, depth = None, 0, 1
    if not params.greedy and spec:  # sampled text depends on the drafting: replay it where it is deterministic
        drafter = _model_free_drafter(spec)
        if drafter is None:
            return rc.Check("recompute", False, "a sampled run with a draft model cannot be recomputed here")
        k, depth = spec["k"], spec["depth"]
    want = body["output_ids"]
    block = Block(model.ckpt, 0, model.ckpt.num_layers, dtype=model.dtype)  # as the peers computed (auto)

    async def _run() -> list[int]:
        got: list[int] = []
        async for tok in generate_on(LocalSession(block), model, ids, params=params, rng=Randomness(params.seed),
                                     drafter=drafter, k=k, depth=depth, max_new=len(want), stop_at_eos=False,
                                     stats=GenerationStats()):
            got.append(tok.id)
        return got

    got = trio.run(_run)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    how = "exact comparison" if exact else "sampled run: regenerated with its seed, compared exactly"
    return rc.Check("recompute", first is None, f"{len(want)} tokens recomputed locally: identical ({how})"
                    if first is None else f"token {first} differs (local {got[first]}, receipt {want[first]}; {how})")
