"""Write an MXFP4 copy of a gpt-oss checkpoint, stored the way OpenAI ships gpt-oss.

Every expert bank ``model.layers.N.mlp.experts.{gate_up_proj,down_proj}`` (stored transposed,
[E, I, O]) becomes ``..._blocks`` [E, O, I/32, 16] uint8 and ``..._scales`` [E, O, I/32] uint8,
the weight [E, O, I] in blocks of 32 inputs: each block's E8M0 exponent is the smallest power of
two that brings its largest magnitude to at most 6 (the largest E2M1 value), each value is
rounded to the nearest E2M1 value (ties to the even code) and packed two a byte, the even input
in the low nibble. Everything else (attention, router, biases, norms, embeddings, the LM head)
is copied as it is; the config gains gpt-oss's ``quantization_config``. transformers' quantizer
needs triton's kernels (a GPU); this one is written with torch and checked against transformers'
dequantization (tests/unit/inference/test_mxfp4.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from shardnet.errors import CheckpointError
from shardnet.testing.checkpoint_copy import rewrite_checkpoint

BLOCK = 32
E8M0_BIAS = 127
E2M1_MAX = 6.0
#: the magnitudes of E2M1 codes 0..7 (code | 8 is the negative)
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
EXPERT_BANK = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)")
#: what gpt-oss's own config keeps unquantized
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., O, I] (I a multiple of 32) as MXFP4 blocks [..., O, I/32, 16] and E8M0
    scales [..., O, I/32], both uint8."""
    *lead, inputs = weight.shape
    if inputs % BLOCK:
        raise CheckpointError(f"MXFP4 needs a multiple of {BLOCK} inputs, not {inputs}")
    w = weight.float().reshape(*lead, inputs // BLOCK, BLOCK)
    amax = w.abs().amax(-1)
    # 2^e >= amax / 6, e an integer in E8M0's range (an all-zero block gets the smallest scale)
    exp = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-E8M0_BIAS, E8M0_BIAS)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -E8M0_BIAS))
    mag = torch.ldexp(w.abs(), -exp.unsqueeze(-1)).clamp(max=E2M1_MAX).contiguous()
    mids = (E2M1_MAGNITUDES[1:] + E2M1_MAGNITUDES[:-1]) / 2
    low, high = torch.bucketize(mag, mids, right=False), torch.bucketize(mag, mids, right=True)
    code = torch.where(low % 2 == 0, low, high)  # they differ only on a tie: take the even code
    code = (code | (torch.signbit(w).to(code.dtype) << 3)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + E8M0_BIAS).to(torch.uint8)


def quantize_checkpoint_mxfp4(src: str | Path, dst: str | Path) -> Path:
    """Write ``src``'s (a gpt_oss checkpoint) MXFP4 copy to ``dst``; returns ``dst``."""
    src = Path(src)
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "gpt_oss":
        raise CheckpointError(f"MXFP4 checkpoints are gpt-oss's layout: it needs --family gpt_oss, not "
                              f"{config.get('model_type')!r}")
    for key in ("hidden_size", "intermediate_size"):  # the experts' inputs, in blocks of 32
        if config[key] % BLOCK:
            raise CheckpointError(f"MXFP4 needs a {key} that is a multiple of {BLOCK}, not {config[key]}")

    def convert(name, t, _):
        if EXPERT_BANK.fullmatch(name):
            blocks, scales = quantize_mxfp4(t.transpose(-1, -2))
            return {name + "_blocks": blocks, name + "_scales": scales}
        return {name: t}

    config["quantization_config"] = {"modules_to_not_convert": MODULES_TO_NOT_CONVERT, "quant_method": "mxfp4"}
    return rewrite_checkpoint(src, dst, convert, config)
