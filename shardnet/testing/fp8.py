"""Write an FP8 block-scaled copy of a checkpoint, stored the way DeepSeek-V3 and Qwen3-FP8 ship.

Which tensors are quantized mirrors transformers' fine-grained FP8 integration
(``replace_with_fp8_linear``): the weight of every plain ``nn.Linear`` and of every grouped
``*.experts`` module, minus what ``get_keys_to_not_convert`` keeps (the LM head, tied and last
parameters). In a decoder layer that is the attention projections and the MLP, shared-expert and
per-expert projections; norms, biases, the embedding, the LM head and the routers' gate weights
(router modules, not ``nn.Linear``) stay as stored, as in the released checkpoints. Only 2-D
weights are quantized (transposed 3-D expert banks such as gpt-oss's are left alone).

Each quantized ``X.weight`` becomes float8_e4m3fn with ``X.weight_scale_inv`` (float32, one per
``block`` of rows x cols, the edge blocks partial when the shape does not divide, as DeepSeek-V3's
576-row ``kv_a_proj_with_mqa`` in 128-row blocks): the scale is amax(|block|) / 448, the largest
e4m3 value, and dequantizing multiplies by it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardnet.testing.checkpoint_copy import rewrite_checkpoint

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (2-D) as float8_e4m3fn and its float32 scales, one per ``block``."""
    rows, cols = block
    out_f, in_f = weight.shape
    grid = (-(-out_f // rows), -(-in_f // cols))
    padded = torch.zeros(grid[0] * rows, grid[1] * cols, dtype=torch.float32)
    padded[:out_f, :in_f] = weight.float()
    tiles = padded.reshape(grid[0], rows, grid[1], cols)
    amax = tiles.abs().amax(dim=(1, 3))
    # an all-zero block keeps scale 1 (as transformers' Fp8Quantize): nothing to scale, no 0/0
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:out_f, :in_f].contiguous(), scale.float()


def fp8_module_names(config) -> tuple[set[str], set[str]]:
    """The ``nn.Linear`` modules and the grouped ``*.experts`` modules transformers' FP8
    integration converts in the model built from ``config``."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = get_keys_to_not_convert(model)
    linears, experts = set(), set()
    for name, module in model.named_modules():
        if not should_convert_module(name, skip):
            continue
        if name.endswith(".experts"):
            experts.add(name)
        elif type(module) is torch.nn.Linear:
            linears.add(name)
    return linears, experts


def quantized_names(names, config) -> set[str]:
    """Which of the checkpoint tensors ``names`` an FP8 release of the model stores in FP8."""
    linears, experts = fp8_module_names(config)
    out = set()
    for n in names:
        if not (n.startswith("model.layers.") and n.endswith(".weight")):
            continue
        module = n[:-len(".weight")]
        # per-expert checkpoint tensors (mlp.experts.3.gate_proj.weight) belong to the grouped
        # experts module transformers builds (mlp.experts)
        if module in linears or any(module.startswith(e + ".") for e in experts):
            out.add(n)
    return out


def quantize_checkpoint_fp8(src: str | Path, dst: str | Path, block: tuple[int, int] = (16, 16)) -> Path:
    """Write ``src``'s FP8 block-scaled copy to ``dst`` (same files, shards and tokenizer; the
    config gains DeepSeek-V3's ``quantization_config``); returns ``dst``."""
    from safetensors import safe_open
    from transformers import AutoConfig

    src = Path(src)
    names = [n for f in sorted(src.glob("*.safetensors")) for n in safe_open(str(f), "pt").keys()]
    quantize = quantized_names(names, AutoConfig.from_pretrained(str(src), local_files_only=True))

    def convert(name, t, _):
        if name in quantize and t.dim() == 2:
            q, scale = quantize_fp8_blocks(t, block)
            return {name: q, name + "_scale_inv": scale}
        return {name: t}

    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    return rewrite_checkpoint(src, dst, convert, config)


def dequantized_reference(fp8_dir: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The unquantized checkpoint an FP8 one stands for: every FP8 weight times its block scales,
    in ``dtype``, the scales and ``quantization_config`` dropped (what transformers loads as a
    plain model, and what a correct FP8 load must compute with)."""
    fp8_dir = Path(fp8_dir)
    config = json.loads((fp8_dir / "config.json").read_text())
    rows, cols = config.pop("quantization_config")["weight_block_size"]

    def convert(name, t, tensors):
        if name.endswith("_scale_inv"):
            return {}
        scale = tensors.get(name + "_scale_inv")
        if scale is not None:
            # written out independently of shardnet's fp8.py, so the comparison means something
            full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:t.shape[0], :t.shape[1]]
            t = (t.float() * full).to(dtype)
        return {name: t}

    return rewrite_checkpoint(fp8_dir, dst, convert, config)
