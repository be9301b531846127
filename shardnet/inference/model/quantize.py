"""Weight-only quantization of a block's layers at load, with torchao.

Why torchao: of the four well-kept libraries the issue names, it is the one that quantizes both
kinds of weight a decoder layer has. bitsandbytes and hqq replace ``nn.Linear`` modules with their
own and cannot touch the 3-D expert banks of transformers' MoE modules (``experts.gate_up_proj``
[E, 2I, H], ``experts.down_proj`` [E, H, I]), which hold most of an MoE model's bytes; torchao's
quantized weights are tensor subclasses, so an ``Int8Tensor`` expert bank stays the module's own
parameter and transformers' own expert loop (``bank[expert]`` then ``F.linear``) runs on it. It
runs on CPU and CUDA (int8 in any compute dtype on both; int4 through PyTorch's tinygemm kernels,
``_weight_int4pack_mm_for_cpu`` on CPU and ``_weight_int4pack_mm`` on CUDA, which needs bfloat16),
installs without touching torch (no dependencies of its own), and is PyTorch's own, released
monthly; optimum-quanto, which also ran here, has been in maintenance mode since late 2025.

Measured on this machine (torch 2.13 CPU, one 1024x1024 Linear, 4 tokens): int8 holds 1.05 MB of
the 2.10 MB bfloat16 weight (4.19 MB float32), max abs output error 0.008 on outputs up to 2.4;
int4 (group 128) holds 0.56 MB, error 0.15.

What each mode does to one decoder layer:

- ``int8``: every Linear weight and every expert bank becomes int8 with one scale per output row.
- ``int4``: Linear weights become 4-bit with one scale and zero point per group of 128 (64, 32
  where the input width needs it) inputs (a Linear whose input width no group size divides is
  int8); expert banks become 4-bit too, as ``IntGroups`` (torchao has no 4-bit tensor for 3-D
  weights on CPU): round-to-nearest with a scale and zero point per group in the compute dtype,
  kept packed in a ``StoredWeight`` (stored.py), one expert dequantized as it runs.
- Routers (a Linear with fewer than ``MIN_QUANTIZED_OUT`` outputs, e.g. Qwen2-MoE's
  ``shared_expert_gate``) stay in the compute dtype: they are tiny and decide discrete routing.
- A quantized expert module runs transformers' "eager" experts implementation (a loop over the hit
  experts): ``grouped_mm`` and ``batched_mm`` need ops torchao's int8 tensor does not implement.
- Transposed expert banks (gpt-oss: ``x @ bank[e]``; torchao's int8 tensor has only
  ``F.linear``) are ``IntGroups`` in both modes (int8: one group a row).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from shardnet.errors import ShardnetError
from shardnet.inference.model.stored import StoredWeight, dequantize_rows

log = logging.getLogger(__name__)

#: what ``--quantize`` accepts
QUANT_MODES = ("int8", "int4")
#: int4 group sizes, preferred first (torchao's tinygemm kernels take these three)
INT4_GROUP_SIZES = (128, 64, 32)
#: Linears with fewer outputs are routers or gates: left unquantized
MIN_QUANTIZED_OUT = 32
#: the names transformers gives an expert bank's 3-D weights
EXPERT_WEIGHT_NAMES = ("gate_up_proj", "down_proj", "up_proj", "gate_proj")
TORCHAO_REQUIREMENT = "torchao>=0.18,<0.19"


class QuantizationError(ShardnetError):
    """A quantization mode is unknown or cannot run on this device and dtype."""

    code = "quantization"


def _torchao():
    """torchao's quantization API, imported quietly: on a CPU-only torch its CUDA extension
    libraries fail to load, which it logs as warnings although nothing here needs them."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.quantization as ao
    except ImportError:
        raise QuantizationError(f"weight quantization needs torchao: pip install '{TORCHAO_REQUIREMENT}'") \
            from None
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return ao


def check_mode(mode: str) -> str:
    if mode not in QUANT_MODES:
        raise QuantizationError(f"unknown quantization {mode!r} (choose from {', '.join(QUANT_MODES)})")
    return mode


def _is_quantized(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter)


def int4_group_size(in_features: int) -> int | None:
    """The int4 group size for a weight with this many inputs; None where none divides it."""
    return next((g for g in INT4_GROUP_SIZES if in_features % g == 0), None)


def _expert_banks(module: torch.nn.Module) -> list[tuple[torch.nn.Module, list[str]]]:
    """(experts module, names of its 3-D weights) for each expert bank under ``module``: the
    modules transformers' ``use_experts_implementation`` made (they carry ``is_transposed``)."""
    banks = []
    for sub in module.modules():
        if not hasattr(sub, "is_transposed"):
            continue
        names = [n for n in EXPERT_WEIGHT_NAMES
                 if isinstance(getattr(sub, n, None), torch.nn.Parameter) and getattr(sub, n).dim() == 3]
        if names:
            banks.append((sub, names))
    return banks


def quantize_module(module: torch.nn.Module, mode: str) -> None:
    """Quantize in place the Linear weights and expert banks of ``module`` (one decoder layer),
    already on its device and in its compute dtype. Raises QuantizationError where ``mode`` cannot
    run on that device and dtype. Weights already quantized are left as they are.

    The quantized weights are made as inference tensors (they are frozen anyway): torchao's
    indexing of an expert bank, ``bank[e]``, fails under ``torch.inference_mode`` (Block.forward's)
    on a bank made outside it ("Cannot set version_counter for inference tensor").

    The parameters left unquantized (norms, routers) are copied: loaded from safetensors they are
    views of the checkpoint file's mapping, and one small norm kept the whole mapping, with every
    page of the full-precision weights quantization read, resident (250 MiB of a 4-layer llama
    block of width 2048)."""
    check_mode(mode)
    with torch.inference_mode():
        _quantize(module, mode)
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and not _is_quantized(p):
                sub._parameters[name] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)


def _quantize(module: torch.nn.Module, mode: str) -> None:
    weights = [p for p in module.parameters() if p.dim() >= 2 and not _is_quantized(p)]
    if not weights:
        return
    device, dtype = weights[0].device, weights[0].dtype
    if device.type not in ("cpu", "cuda"):
        raise QuantizationError(f"{mode} quantization runs on cpu and cuda, not {device.type}")
    if mode == "int4" and device.type == "cuda" and dtype != torch.bfloat16:
        raise QuantizationError(f"int4 on cuda needs --dtype bfloat16 (torchao's int4 CUDA kernel), "
                                f"not {str(dtype).removeprefix('torch.')}")
    ao = _torchao()
    int8 = ao.Int8WeightOnlyConfig(set_inductor_config=False)

    def int4(group_size: int):
        if device.type == "cpu":
            from torchao.prototype.quantization.int4.inference_workflow import (
                PrototypeInt4WeightOnlyConfig,
            )

            return PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
        return ao.Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                       set_inductor_config=False)

    for name, linear in module.named_modules():
        if not isinstance(linear, torch.nn.Linear) or _is_quantized(linear.weight):
            continue
        if linear.out_features < MIN_QUANTIZED_OUT:
            continue
        group = int4_group_size(linear.in_features) if mode == "int4" else None
        try:
            ao.quantize_(linear, int4(group) if group else int8)
        except (RuntimeError, AssertionError, NotImplementedError, ValueError) as e:
            raise QuantizationError(f"{mode} quantization of {name} {tuple(linear.weight.shape)} "
                                    f"failed on {device.type}/{dtype}: {str(e).splitlines()[0]}") from None
    for experts, names in _expert_banks(module):
        names = [n for n in names if not _is_quantized(getattr(experts, n))]
        if not names:
            continue
        if mode == "int4" or experts.is_transposed:
            # torchao has no 4-bit 3-D tensor on CPU, and its int8 tensor no ``x @ bank[e]``
            # (gpt-oss's transposed banks): kept as IntGroups, one expert dequantized per call
            for n in names:
                bank = getattr(experts, n)
                setattr(experts, n, torch.nn.Parameter(
                    quantize_bank(bank, 4 if mode == "int4" else 8, transposed=experts.is_transposed),
                    requires_grad=False))
        else:
            try:
                ao.quantize_(experts, ao.FqnToConfig({n: int8 for n in names}), filter_fn=None)
            except (RuntimeError, AssertionError, NotImplementedError, ValueError) as e:
                raise QuantizationError(f"{mode} quantization of {type(experts).__name__} failed on "
                                        f"{device.type}/{dtype}: {str(e).splitlines()[0]}") from None
        # the config is the whole model's; this module alone switches to the per-expert loop
        experts.config = copy.copy(experts.config)
        experts.config._experts_implementation = "eager"


@dataclass(frozen=True)
class IntGroups:
    """Asymmetric round-to-nearest integers of ``bits`` (4: two a byte; 8) with a scale and a
    zero point in the compute dtype per ``group`` inputs: parts ``q`` uint8 [..., O, I*bits/8],
    ``scale`` and ``zero`` [..., O, I/group]. What ``--quantize`` makes of expert banks."""

    bits: int
    group: int
    name = "int-groups"

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q = parts["q"]
        if self.bits == 4:
            q = torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2)
        *lead, rows, cols = q.shape
        grouped = q.view(*lead, rows, cols // self.group, self.group).to(dtype)
        w = (grouped - parts["zero"].unsqueeze(-1)) * parts["scale"].unsqueeze(-1)
        return w.view(*lead, rows, cols)

    def dequantize_into(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        step = max(1, (1 << 20) // out.shape[-1])
        dequantize_rows(self.dequantize, parts, out, dict.fromkeys(parts, 1), step)


def quantize_bank(bank: torch.Tensor, bits: int, *, transposed: bool = False) -> StoredWeight:
    """An expert bank [E, O, I] (``transposed``: [E, I, O], used as ``x @ bank[e]``) as
    ``IntGroups`` of ``bits``: 4 bits in groups of 128 (64, 32, else the whole row) inputs, 8
    bits one group a row."""
    w = bank.detach().transpose(-1, -2) if transposed else bank.detach()
    inputs = w.shape[-1]
    group = (int4_group_size(inputs) or inputs) if bits == 4 else inputs
    if bits == 4 and inputs % 2:
        raise QuantizationError(f"int4 expert weights need an even input width, not {inputs}")
    # one expert at a time: its float32 intermediates, not the whole bank's, are what it costs
    pieces = [_int_groups(w[e], bits, group) for e in range(w.shape[0])] if w.dim() == 3 \
        else [_int_groups(w, bits, group)]
    q, scale, zero = (torch.stack(p) if w.dim() == 3 else p[0] for p in zip(*pieces))
    parts = {"q": q, "scale": scale.to(bank.dtype), "zero": zero.to(bank.dtype)}
    return StoredWeight(IntGroups(bits, group), parts, bank.shape, bank.dtype, transposed=transposed)


def _int_groups(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[O, I] as round-to-nearest integers (``bits``: two a byte for 4), float32 scales and zero
    points per ``group`` inputs."""
    levels = (1 << bits) - 1
    g = w.float().unflatten(-1, (w.shape[-1] // group, group))
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / levels).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, levels)
    q = ((g / scale.unsqueeze(-1)).round() + zero.unsqueeze(-1)).clamp(0, levels).to(torch.uint8).flatten(-2)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q.contiguous(), scale, zero


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds; for a tensor subclass (a quantized weight) the sum of its inner tensors."""
    if isinstance(t, StoredWeight):
        return t.stored_nbytes()
    if hasattr(type(t), "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(x) for x in (getattr(t, n) for n in inner) if isinstance(x, torch.Tensor))
    return t.numel() * t.element_size()


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes the weights (parameters and buffers) of ``module`` really take, quantized or not;
    a tensor shared by two modules counts once."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += _tensor_bytes(t)
    return total


def bytes_per_param(mode: str | None, dtype_bytes: int, *, in_features: int | None = None,
                    expert: bool = False) -> float:
    """Estimated bytes one weight parameter costs under ``mode`` (None: unquantized), scales
    included, for placement. ``dtype_bytes``: the compute dtype's size. ``in_features``: the
    weight's input width where known (int4's group size, the per-row scale's share); unknown
    assumes the worst case. ``expert``: a weight of an MoE expert bank (``IntGroups`` in int4)."""
    if mode is None or mode == "none":
        return float(dtype_bytes)
    check_mode(mode)
    # int8: one byte, plus per output row a float32 scale and a 1-byte zero point (torchao's
    # Int8Tensor), spread over the row's inputs; 256 inputs is the narrowest layer worth planning
    row = in_features or 256
    if mode == "int8":
        return 1.0 + 5.0 / row
    group = int4_group_size(in_features) if in_features else INT4_GROUP_SIZES[-1]
    if group is None:
        return 1.0 + 5.0 / row
    # int4: half a byte, plus per group a scale and a zero point in the compute dtype
    return 0.5 + 2.0 * dtype_bytes / group
