"""Checkpoints stored in FP8 with block scales (DeepSeek-V3's and Qwen3-FP8's layout).

Each quantized linear weight ``W`` is stored as float8_e4m3fn with a companion
``W_scale_inv`` holding one float32 factor per (rows x cols) block of the weight, the block size
given by ``quantization_config.weight_block_size``. Hardware without FP8 matmuls (every CPU, GPUs
before Hopper) computes with the dequantized weight: ``W.float() * scale`` per block, cast to the
compute dtype, at load. Tensors without a scale (norms, embeddings, routers) pass through
unchanged; an FP8 one without its scale is refused.
"""

from __future__ import annotations

import torch

from shardnet.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"


def dequantize_fp8_blocks(tensors: dict[str, torch.Tensor], block: tuple[int, int],
                          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``tensors`` with every FP8 weight dequantized into ``dtype`` and the scales dropped."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            if name[:-len(SCALE_SUFFIX)] not in tensors:
                raise CheckpointError(f"{name} scales a tensor that is not in the checkpoint")
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            if t.dtype.is_floating_point and t.element_size() == 1:
                # read as it is, the weight would be off by its scales, silently
                raise CheckpointError(f"{name} is stored in {str(t.dtype).removeprefix('torch.')} but has no "
                                      f"{name}{SCALE_SUFFIX} (its block scales)")
            out[name] = t
            continue
        out[name] = dequantize(t, scale, block, name).to(dtype)
    return out


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str = "weight"
               ) -> torch.Tensor:
    rows, cols = block
    if weight.dim() != 2 or scale.dim() != 2:
        raise CheckpointError(f"{name}: FP8 block scales need a 2-D weight and scale, not {list(weight.shape)} "
                              f"and {list(scale.shape)}")
    want = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{name}: its scale has shape {list(scale.shape)}, but {list(weight.shape)} in "
                              f"blocks of {rows}x{cols} needs {list(want)}")
    full = scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return weight.float() * full[:weight.shape[0], :weight.shape[1]]
