"""Checkpoints stored in FP8 with block scales (DeepSeek-V3's and Qwen3-FP8's layout).

Each quantized linear weight ``W`` is stored as float8_e4m3fn with a companion
``W_scale_inv`` holding one float32 factor per (rows x cols) block of the weight, the block size
given by ``quantization_config.weight_block_size``. Hardware without FP8 matmuls (every CPU, GPUs
before Hopper) computes with the dequantized weight: ``W.float() * scale`` per block, cast to the
compute dtype, one weight at a time as it runs: the block keeps the FP8 bytes and the scales
(``stored_fp8_blocks``: a ``StoredWeight`` each, stored.py). Tensors without a scale (norms, embeddings, routers) pass through
unchanged; an FP8 one without its scale is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardnet.errors import CheckpointError
from shardnet.inference.model.stored import StoredWeight, dequantize_rows

#: about this many weights (at least a row of blocks) are dequantized at a time into the reused
#: buffer (1 MiB of float32: the size made no difference to the time, 2^16 to 2^20 tried)
CHUNK = 1 << 18

SCALE_SUFFIX = "_scale_inv"
#: names of the tensors that only accompany a quantized weight (formats.py)
COMPANION_SUFFIXES = (SCALE_SUFFIX,)


def parse(q: dict) -> dict:
    """``{"quant_method": "fp8", "weight_block_size": [rows, cols]}`` (DeepSeek-V3's, Qwen3-FP8's)."""
    block = q.get("weight_block_size")
    if isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        return {"block": (block[0], block[1])}
    raise CheckpointError("stored quantization 'fp8' is supported with weight_block_size (as DeepSeek-V3 and "
                          f"Qwen3-FP8 ship), not {block!r}")


def to_stored(tensors: dict[str, torch.Tensor], params: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return stored_fp8_blocks(tensors, params["block"], dtype)


def held_bytes(name: str, info, dtype_bytes: int, params: dict) -> int:
    """FP8 weights and their float32 scales as stored; other tensors in the compute dtype."""
    n = 1
    for d in info.shape:
        n *= d
    if name.endswith(SCALE_SUFFIX):
        return n * 4
    return n * (1 if info.dtype in ("F8_E4M3", "F8_E5M2") else dtype_bytes)


@dataclass(frozen=True)
class Fp8Blocks:
    """FP8 e4m3 with one float32 scale per (rows x cols) block: parts ``weight`` [..., O, I] and
    ``scale`` [..., ceil(O/rows), ceil(I/cols)]."""

    block: tuple[int, int]
    name = "fp8-blocks"

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(parts["weight"], parts["scale"], self.block).to(dtype)

    def dequantize_into(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        rows = self.block[0]
        step = max(1, CHUNK // (rows * out.shape[-1])) * rows
        dequantize_rows(self.dequantize, parts, out, {"weight": 1, "scale": rows}, step)

    def cat(self, parts_list: list[dict[str, torch.Tensor]], dim: int, shapes) -> dict[str, torch.Tensor] | None:
        """Joined along out (-2) or in (-1) where every piece but the last fills whole blocks."""
        step = self.block[0] if dim == -2 else self.block[1]
        if any(shape[dim] % step for shape in shapes[:-1]):
            return None
        return {k: torch.cat([p[k] for p in parts_list], dim) for k in ("weight", "scale")}


def stored_fp8_blocks(tensors: dict[str, torch.Tensor], block: tuple[int, int],
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``tensors`` with every FP8 weight kept as stored (a ``StoredWeight`` of compute dtype
    ``dtype`` holding the weight and its scales) and the scales' own entries dropped."""
    fmt = Fp8Blocks(tuple(block))
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            if name[:-len(SCALE_SUFFIX)] not in tensors:
                raise CheckpointError(f"{name} scales a tensor that is not in the checkpoint")
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            if t.dtype.is_floating_point and t.element_size() == 1:
                raise CheckpointError(f"{name} is stored in {str(t.dtype).removeprefix('torch.')} but has no "
                                      f"{name}{SCALE_SUFFIX} (its block scales)")
            out[name] = t
            continue
        _check(t, scale, fmt.block, name)
        out[name] = StoredWeight(fmt, {"weight": t, "scale": scale.float()}, t.shape, dtype)
    return out


def _check(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> None:
    rows, cols = block
    if weight.dim() != 2 or scale.dim() != 2:
        raise CheckpointError(f"{name}: FP8 block scales need a 2-D weight and scale, not {list(weight.shape)} "
                              f"and {list(scale.shape)}")
    want = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{name}: its scale has shape {list(scale.shape)}, but {list(weight.shape)} in "
                              f"blocks of {rows}x{cols} needs {list(want)}")


#: each FP8 dtype's 256 codes as float32, in the order of their bytes: torch's own conversion of
#: every code, looked up by byte. On CPU torch converts FP8 one element at a time; the lookup
#: gives the same bits (tests/unit/inference/test_stored_weight.py: every code) several times
#: faster (docs/benchmarks.md)
FLOAT32_OF_CODE = {dtype: torch.arange(256, dtype=torch.uint8).view(dtype).float()
                   for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}


def to_float32(weight: torch.Tensor) -> torch.Tensor:
    """``weight.float()``, bit for bit: FP8 on CPU read from ``FLOAT32_OF_CODE``."""
    table = FLOAT32_OF_CODE.get(weight.dtype)
    if table is None or weight.device.type != "cpu":
        return weight.float()
    codes = weight.reshape(-1).view(torch.uint8).int()  # (index_select takes int32 indices)
    return table.index_select(0, codes).view(weight.shape)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[..., O, I] FP8 times its [..., ceil(O/rows), ceil(I/cols)] block scales, in float32
    (shapes checked at load: ``stored_fp8_blocks``)."""
    rows, cols = block
    *lead, out, inp = weight.shape
    if out % rows == 0 and inp % cols == 0:  # (no full-size copy of the scales)
        blocks = to_float32(weight).view(*lead, out // rows, rows, inp // cols, cols)
        return (blocks * scale.float()[..., :, None, :, None]).view(*lead, out, inp)
    full = scale.float().repeat_interleave(rows, -2).repeat_interleave(cols, -1)
    return to_float32(weight) * full[..., :out, :inp]
