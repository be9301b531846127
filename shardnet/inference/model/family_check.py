"""Before a checkpoint is first served: does shardnet's split reproduce transformers on it?

A block applies what the family's adapter declares around transformers' own layers; a family
run generically, or a config using a feature no test covered, may need more. So the first time a
checkpoint is loaded, its first layer runs both ways on a few tokens: shardnet's (head embedding,
a one-layer block, head norm and logits, as the chain computes them) and transformers' (the
family's causal LM built with that one layer, forward as transformers runs it). Any difference
beyond float rounding refuses the checkpoint with a one-line reason. The verdict is kept beside
the manifest cache, keyed on the model ID and the transformers version.
"""

from __future__ import annotations

import copy
import json
import logging

import torch

from shardnet.errors import CheckpointError
from shardnet.inference.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)

VERDICT_CACHE = ".shardnet-family-check.json"
#: tokens run through the first layer (a few positions exercise the causal mask and rotary)
CHECK_TOKENS = 7
#: max |logit difference| allowed, relative to the largest |logit|: float32 rounding of the same
#: ops in another order stays orders of magnitude below it; a missed scale or cap does not
RELATIVE_TOLERANCE = 1e-3


def ensure_family_matches(ckpt: Checkpoint) -> None:
    """Refuse ``ckpt`` (CheckpointError) if its first layer does not run as transformers runs it.
    Runs once per checkpoint and transformers version; skipped where layer 0 or the head are not
    stored locally."""
    import transformers

    parts = ckpt.head_parts()
    if not ckpt.holds(ckpt.layer_tensors(0) + parts["embed"] + parts["norm"] + parts["lm_head"]):
        log.info("%s holds not all of layer 0 and the head: its family is not checked here", ckpt.path.name)
        return
    key = {"model_id": ckpt.model_id, "transformers": transformers.__version__, "family": repr(ckpt.family)}
    cache = ckpt.path / VERDICT_CACHE
    try:
        cached = json.loads(cache.read_text())
    except (OSError, json.JSONDecodeError):
        cached = None
    if isinstance(cached, dict) and cached.get("key") == key:
        if cached.get("refused"):
            raise CheckpointError(cached["refused"])
        return
    verdict = _compare_first_layer(ckpt)
    try:
        cache.write_text(json.dumps({"key": key, "refused": verdict}))
    except OSError:
        pass  # read-only model directory: check again next time
    if verdict:
        raise CheckpointError(verdict)


def _compare_first_layer(ckpt: Checkpoint) -> str | None:
    from shardnet.inference.model.block import Block, Head
    from shardnet.inference.model.shell import ModelShell

    log.info("checking %s (%s) against transformers on its first layer (once)", ckpt.path.name, ckpt.model_type)
    ids = torch.arange(CHECK_TOKENS).unsqueeze(0) * 7 % int(ckpt.config.vocab_size)
    try:
        head = Head(ckpt)
        block = Block(ckpt, 0, 1)
        mine = head.logits(block.forward(head.embed(ids), block.new_cache(), 0))[0]

        one_layer = copy.deepcopy(ckpt.config)
        one_layer.num_hidden_layers = 1
        if getattr(one_layer, "layer_types", None):
            one_layer.layer_types = one_layer.layer_types[:1]
        shell = ModelShell(ckpt, torch.float32, one_layer)
        parts = ckpt.head_parts()
        shell.load(parts["embed"] + parts["norm"] + parts["lm_head"] + ckpt.layer_tensors(0),
                   device="cpu")
        if not parts["lm_head"]:
            shell.model.tie_weights()
        model = shell.take(shell.model, "", "cpu")
        with torch.inference_mode():
            theirs = model(input_ids=ids).logits[0].float()
    except (CheckpointError, MemoryError, OSError):
        raise  # not a verdict on the family: nothing is kept, the next load checks again
    except Exception as e:  # noqa: BLE001 - any failure to run the family is a refusal, said in one line
        text = " ".join(str(e).split())[:200] or type(e).__name__
        return (f"model_type {ckpt.model_type!r} is not supported: its first layer does not run as a shardnet block "
                f"({type(e).__name__}: {text})")
    scale = max(theirs.abs().max().item(), 1.0)
    diff = (mine - theirs).abs().max().item()
    if not diff <= RELATIVE_TOLERANCE * scale:
        return (f"model_type {ckpt.model_type!r} is not supported: on its first layer shardnet's logits differ from "
                f"transformers' by {diff:.3g} (of {scale:.3g}); its family needs an adapter")
    log.info("%s matches transformers on its first layer (max logit difference %.2g)", ckpt.path.name, diff)
    return None
