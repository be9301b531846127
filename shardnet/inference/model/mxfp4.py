"""Checkpoints whose experts are stored in MXFP4 (gpt-oss's layout, as OpenAI ships it).

gpt-oss stores each expert bank's weight as two uint8 tensors (``quantization_config``
``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``):

- ``...mlp.experts.gate_up_proj_blocks`` [E, O, I/32, 16]: the weight [E, O, I] (O outputs, I
  inputs: 2*intermediate x hidden for gate_up, hidden x intermediate for down) in blocks of 32
  inputs, two 4-bit E2M1 values a byte, the even input in the low nibble;
- ``..._scales`` [E, O, I/32]: one E8M0 exponent per block (2^(byte - 127)).

The unquantized model's bank is the transpose, ``gate_up_proj`` [E, I, O] (gpt-oss computes
``x @ bank[e]``): each pair becomes one ``StoredWeight`` of that shape, transposed over its parts,
so ``bank[e]`` is a view and ``x @ bank[e]`` dequantizes that one expert as it runs
(``dequantize_transposed``: what transformers' ``convert_moe_packed_tensors`` returns, bit for
bit, in the same layout). GPUs with an MXFP4 kernel (transformers uses
triton's ``matmul_ogs`` on Hopper) compute from the packed bytes; none is used here: ``Mxfp4``
has no ``cuda_linear`` (stored.py's opt-in kernel hook), as no MXFP4 kernel package installs here
without triton and hub access. The biases,
router, attention, norms and embeddings are stored in bf16 and pass through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardnet.errors import CheckpointError
from shardnet.inference.model.stored import StoredWeight

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
#: names of the tensors that only accompany a quantized weight and are not kept when a peer
#: quantizes its block anew (formats.py, placement): none, since ``join --quantize`` leaves the
#: MXFP4 banks as they are (their scales included) and quantizes the attention's Linear weights
COMPANION_SUFFIXES = ()
#: inputs per block (one E8M0 scale each), and bytes a block's 4-bit values take
BLOCK = 32
BLOCK_BYTES = BLOCK // 2
#: the E2M1 value of each 4-bit code (transformers' ``FP4_VALUES``: bit 3 is the sign)
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


def parse(q: dict) -> dict:
    """``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`` (gpt-oss's): the packed
    tensors say which weights are quantized, so there is nothing to keep."""
    skip = q.get("modules_to_not_convert", [])
    if not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
        raise CheckpointError(f"stored quantization 'mxfp4': modules_to_not_convert must be a list of module names "
                              f"(as gpt-oss ships), not {skip!r}")
    return {}


def to_stored(tensors: dict[str, torch.Tensor], params: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``tensors`` with each ``X_blocks`` + ``X_scales`` pair kept as one ``StoredWeight`` ``X``
    of logical shape [E, I, O] in compute ``dtype``; every other tensor as it is."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALES_SUFFIX):
            if name[:-len(SCALES_SUFFIX)] + BLOCKS_SUFFIX not in tensors:
                raise CheckpointError(f"{name} scales MXFP4 blocks that are not in the checkpoint")
            continue
        if not name.endswith(BLOCKS_SUFFIX):
            out[name] = t
            continue
        base = name[:-len(BLOCKS_SUFFIX)]
        scales = tensors.get(base + SCALES_SUFFIX)
        if scales is None:
            raise CheckpointError(f"{name} is MXFP4 but has no {base}{SCALES_SUFFIX} (its block exponents)")
        _check(t, scales, name)
        *bank, rows, groups, _ = t.shape
        out[base] = StoredWeight(Mxfp4(), {"blocks": t, "scales": scales}, (*bank, groups * BLOCK, rows), dtype,
                                 transposed=True)
    return out


def held_bytes(name: str, info, dtype_bytes: int, params: dict) -> int:
    """Packed values and exponents as stored (a byte each); other tensors in the compute dtype."""
    n = 1
    for d in info.shape:
        n *= d
    return n * (1 if name.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX)) else dtype_bytes)


@dataclass(frozen=True)
class Mxfp4:
    """MXFP4: parts ``blocks`` [..., O, I/32, 16] uint8 (two E2M1 codes a byte) and ``scales``
    [..., O, I/32] uint8 (E8M0); the weight [..., O, I]."""

    name = "mxfp4"

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        # the transpose of gpt-oss's bank layout: a StoredWeight's transposed view of it is the
        # bank's [..., I, O] contiguous, as transformers' is (a CPU matmul's float32 sums depend
        # on the weight's strides)
        return dequantize_transposed(parts["blocks"], parts["scales"], dtype).mT


#: byte -> the value of its low code, of its high code
_LOW = torch.tensor(FP4_VALUES).repeat(16)
_HIGH = torch.tensor(FP4_VALUES).repeat_interleave(16)


def dequantize_transposed(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight of MXFP4 ``blocks`` [..., O, I/32, 16] and ``scales`` [..., O, I/32],
    transposed ([..., I, O], contiguous: gpt-oss's bank layout) and in ``dtype``: bit for bit what
    transformers' ``convert_moe_packed_tensors`` returns. Each code's E2M1 value times
    2^(scale - 127) in float32 (``torch.ldexp`` multiplies by ``pow(2.0, exponent)`` in float32 there
    too), rounded once into ``dtype``."""
    *lead, rows, groups, nbytes = blocks.shape
    codes = blocks.movedim(-3, -1).contiguous().view(-1).int()  # [..., I/32, 16, O]: the output's order
    values = torch.empty(*lead, groups, nbytes, 2, rows, device=blocks.device)
    for half, table in enumerate((_LOW, _HIGH)):  # the even input is the low nibble
        values.select(-2, half).copy_(table.to(blocks.device).index_select(0, codes).view(*lead, groups, nbytes, rows))
    values *= torch.pow(2.0, scales.int() - E8M0_BIAS).mT[..., None, None, :]
    return values.view(*lead, groups * nbytes * 2, rows).to(dtype)


def _check(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"{name}: MXFP4 blocks and scales are uint8, not {str(blocks.dtype)[6:]} and "
                              f"{str(scales.dtype)[6:]}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"{name}: MXFP4 blocks [..., O, I/32, 16] need scales [..., O, I/32]; got "
                              f"{list(blocks.shape)} and {list(scales.shape)}")
