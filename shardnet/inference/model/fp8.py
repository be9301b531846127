"""Checkpoints stored in FP8 with block scales (DeepSeek-V3's and Qwen3-FP8's layout).

Each quantized linear weight ``W`` is stored as float8_e4m3fn with a companion
``W_scale_inv`` holding one float32 factor per (rows x cols) block of the weight, the block size
given by ``quantization_config.weight_block_size``. Hardware without FP8 matmuls (every CPU, GPUs
before Hopper) computes with the dequantized weight: ``W.float() * scale`` per block, cast to the
compute dtype, one weight at a time as it runs: the block keeps the FP8 bytes and the scales
(``stored_fp8_blocks``: a ``StoredWeight`` each, stored.py). Tensors without a scale (norms, embeddings, routers) pass through
unchanged; an FP8 one without its scale is refused.

GPU kernel (opt-in: ``SHARDNET_STORED_KERNELS=1``, stored.py; not yet run on any device):
``Fp8Blocks.cuda_linear`` computes ``x @ W.T`` with ``torch.nn.functional.scaled_mm`` (torch's
``_scaled_mm``) from the FP8 bytes and scales as stored, quantizing the activations to e4m3 on
the fly (scale = amax / 448 per group; e4m3 keeps 3 mantissa bits, so each activation is
rounded by at most 2^-4 of itself, about 2 % on average: the error DeepSeek-V3's recipe accepts):

- 128x128 weight blocks (DeepSeek-V3, Qwen3-FP8): activations in 1x128 groups, torch's
  ``BlockWise1x128`` x ``BlockWise128x128`` recipe: Hopper (capability 9.x) with CUDA >= 12.9
  (cuBLASLt's block scaling), in and out features multiples of 128;
- one scale per output row (``weight_block_size`` [1, n] with n >= in features): activations per
  row, the ``RowWise`` recipe, capability >= 8.9; in and out features multiples of 16.

bfloat16 activations only (the compute dtype of FP8 checkpoints; the row-wise kernel writes
bfloat16 only). Any other case (other block sizes, another GPU, a CPU) returns None and the
weight is dequantized as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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

    def cuda_linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``x @ W.T`` by ``scaled_mm`` on a CUDA device that has the recipe, else None (module docstring)."""
        weight, scale = parts["weight"], parts["scale"]
        if x.device.type != "cuda" or x.dtype != torch.bfloat16 or weight.dim() != 2 \
                or weight.dtype != torch.float8_e4m3fn or not weight.is_contiguous():
            return None
        out_f, in_f = weight.shape
        capability = torch.cuda.get_device_capability(x.device)
        cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
        x2 = x.reshape(-1, in_f)
        if self.block == (128, 128) and capability[0] == 9 and cuda >= (12, 9) \
                and in_f % 128 == 0 and out_f % 128 == 0:
            xq, xs = quantize_groups(x2, 128)
            k_blocks = in_f // 128
            padded = -(-k_blocks // 4) * 4  # cuBLASLt's scale_b: [ceil(K/128) up to 4s, N/128], column-major
            scale_b = scale.new_zeros(out_f // 128, padded)
            scale_b[:, :k_blocks] = scale
            y = F.scaled_mm(xq, weight.t(), xs.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                            scale_b.t(), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        elif self.block[0] == 1 and self.block[1] >= in_f and capability >= (8, 9) \
                and in_f % 16 == 0 and out_f % 16 == 0:
            xq, xs = quantize_groups(x2, in_f)
            y = F.scaled_mm(xq, weight.t(), xs.contiguous(), F.ScalingType.RowWise,
                            scale.reshape(1, out_f).contiguous(), F.ScalingType.RowWise, output_dtype=torch.bfloat16)
        else:
            return None
        return y.reshape(*x.shape[:-1], out_f)

    def cat(self, parts_list: list[dict[str, torch.Tensor]], dim: int, shapes) -> dict[str, torch.Tensor] | None:
        """Joined along out (-2) or in (-1) where every piece but the last fills whole blocks."""
        step = self.block[0] if dim == -2 else self.block[1]
        if any(shape[dim] % step for shape in shapes[:-1]):
            return None
        return {k: torch.cat([p[k] for p in parts_list], dim) for k in ("weight", "scale")}


E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as float8_e4m3fn and its float32 scales [M, ceil(K/group)], one per ``group``
    consecutive values of a row (amax / 448; an all-zero group gets scale 1): the activations'
    half of a scaled matmul."""
    m, k = x.shape
    groups = -(-k // group)
    g = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (g / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, :k].contiguous(), scale


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
