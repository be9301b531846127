"""Checkpoints stored in 4 bits with group scales: GPTQ, AWQ and compressed-tensors' pack-quantized.

Each quantized linear weight ``W`` [out, in] is stored as 4-bit integers ``q`` packed eight to an
int32, with one scale ``s`` (and, but for symmetric compressed-tensors, one zero point ``z``) per
group of ``group_size`` input columns of each output row: ``W[o, i] = (q[o, i] - z[o, g]) * s[o, g]``
with ``g = i // group_size``. The three methods differ in how they lay the parts out:

- ``gptq`` (AutoGPTQ / GPTQModel / optimum, ``checkpoint_format`` gptq or gptq_v2):
  ``X.qweight`` int32 [in/8, out] (input row ``8r + j`` in bits ``4j`` of row ``r``),
  ``X.qzeros`` int32 [groups, out/8] (column ``8c + j`` in bits ``4j``), ``X.scales`` fp16
  [groups, out], ``X.g_idx`` int32 [in]. The v1 format (``gptq``) stores ``z - 1``: a zero is
  ``(nibble + 1) & 15``, as AutoGPTQ's and optimum's dequantization read it; gptq_v2 stores ``z``.
- ``awq`` (AutoAWQ, version gemm, zero_point true): ``X.qweight`` int32 [in, out/8],
  ``X.qzeros`` int32 [groups, out/8], ``X.scales`` fp16 [groups, out]; the eight columns of an
  int32 are in AWQ's order: bits ``4j`` hold column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][j]``.
- ``compressed-tensors`` (llm-compressor, format pack-quantized, int4, strategy group or
  channel): ``X.weight_packed`` int32 [out, ceil(in/8)] (column ``8c + j`` in bits ``4j``, stored
  as ``q + 8`` for ``q`` in [-8, 7]), ``X.weight_scale`` [out, groups], ``X.weight_shape``
  [out, in], and for asymmetric schemes ``X.weight_zero_point`` int32 [ceil(out/8), groups]
  (packed along out, also offset by 8).

A block keeps the packed weight, scales and zeros exactly as stored (an ``Int4Groups``
``StoredWeight`` each, stored.py) and dequantizes one weight just before it runs (no int4
kernel on CPU). ``g_idx`` (GPTQ) must be the trivial ``i // group_size`` (no act-order
permutation) and is then dropped, as is ``weight_shape`` (the weight's logical shape is kept).
Transformers' MoE key conversion stacks per-expert weights into banks and joins gate and up
along out: both stay stored (``Int4Groups.cat``).

GPU kernel (opt-in: ``SHARDNET_STORED_KERNELS=1``, stored.py; not yet run on any device):
``Int4Groups.cuda_linear`` computes ``x @ W.T`` with PyTorch's int4 tinygemm kernel
(``aten._weight_int4pack_mm``, the one torchao's int4 weight-only CUDA layout calls) for bfloat16
activations on CUDA, with group size 32, 64, 128 or 256, whole groups, in features a multiple of
32 and out features of 8. Each call repacks the stored nibbles into tinygemm's tile layout on the
GPU (``_convert_weight_to_int4pack``; the block keeps only the stored layout, which the CPU
fallback reads) and rewrites the scales and zeros as tinygemm reads them: ``W = (q - 8) * s + m``
with ``m = (8 - z) * s``, both in bfloat16. That rounding (fp16 scales to bf16: 8 mantissa bits
instead of 11) changes the numerics slightly (at most about 2^-9 of ``|8 - z| * s + 8 * s``, a
few hundredths of one quantization step), so it is used on the GPU only and opt-in; the
dequantizing path computes ``(q - z) * s`` exactly. Other cases return None (dequantize).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from shardnet.errors import CheckpointError
from shardnet.inference.model.stored import StoredWeight, dequantize_rows

GPTQ, AWQ, CT = "gptq", "awq", "compressed-tensors"
#: the part names of a quantized weight, per method (``X.<part>`` in the checkpoint)
PARTS = {GPTQ: ("qweight", "qzeros", "scales"), AWQ: ("qweight", "qzeros", "scales"),
         CT: ("weight_packed", "weight_scale", "weight_zero_point")}
#: checkpoint tensors read for the weight, then dropped (the weight's shape, a trivial g_idx)
DROPPED = {GPTQ: ("g_idx",), AWQ: (), CT: ("weight_shape",)}
PACKED = {GPTQ: "qweight", AWQ: "qweight", CT: "weight_packed"}
#: nibble j of an AWQ int32 holds column AWQ_ORDER[j] of its eight; column c is nibble AWQ_REVERSE[c]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_DTYPE_BYTES = {"I32": 4, "U32": 4, "F16": 2, "BF16": 2, "F32": 4, "I64": 8, "I8": 1, "U8": 1, "I16": 2}


def companion_suffixes(method: str) -> tuple[str, ...]:
    return tuple("." + p for p in (*PARTS[method], *DROPPED[method]) if p != PACKED[method])


#: name endings of tensors that only accompany a quantized weight, over the three methods (formats.py)
COMPANION_SUFFIXES = tuple(sorted({s for m in PARTS for s in companion_suffixes(m)}))


# -- parse --------------------------------------------------------------------------------------

def parse(q: dict) -> dict:
    method = q.get("quant_method")
    return {GPTQ: _parse_gptq, AWQ: _parse_awq, CT: _parse_ct}[method](q)


def _refuse(method: str, supported: str, got: str) -> CheckpointError:
    return CheckpointError(f"stored quantization {method!r} is supported as {supported}, not {got}")


def _group_size(method: str, q: dict) -> int:
    gs = q.get("group_size", 128)
    if not isinstance(gs, int) or isinstance(gs, bool) or not (gs == -1 or gs > 0):
        raise _refuse(method, "4 bits with a group_size (or -1: one group per row)", f"group_size {gs!r}")
    return gs


def _parse_gptq(q: dict) -> dict:
    supported = "4 bits, checkpoint_format gptq or gptq_v2, with a trivial g_idx (no act-order permutation)"
    if q.get("bits") != 4:
        raise _refuse(GPTQ, supported, f"bits {q.get('bits')!r}")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(GPTQ, supported, f"checkpoint_format {fmt!r}")
    # desc_act (act-order) is read from each weight's g_idx: refused where it permutes the groups
    return {"method": GPTQ, "group_size": _group_size(GPTQ, q), "zeros_minus_one": fmt == "gptq"}


def _parse_awq(q: dict) -> dict:
    supported = "4 bits, version gemm, zero_point true"
    if q.get("bits", q.get("w_bit")) != 4:
        raise _refuse(AWQ, supported, f"bits {q.get('bits', q.get('w_bit'))!r}")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(AWQ, supported, f"version {version!r}")
    if not q.get("zero_point", True):
        raise _refuse(AWQ, supported, "zero_point false")
    return {"method": AWQ, "group_size": _group_size(AWQ, q)}


def _parse_ct(q: dict) -> dict:
    supported = ("format pack-quantized, int4 weights (strategy group or channel, no activation quantization), "
                 "quantization_status compressed")
    fmt = q.get("format")
    if fmt != "pack-quantized":
        raise _refuse(CT, supported, f"format {fmt!r}")
    if q.get("quantization_status", "compressed") != "compressed":
        raise _refuse(CT, supported, f"quantization_status {q.get('quantization_status')!r}")
    groups = q.get("config_groups") or {}
    if not groups or not isinstance(groups, dict):
        raise _refuse(CT, supported, "no config_groups")
    group_sizes = set()
    for name, scheme in groups.items():
        w = (scheme or {}).get("weights") if isinstance(scheme, dict) else None
        if not isinstance(w, dict):
            raise _refuse(CT, supported, f"config group {name!r} without weights")
        got = (f"{w.get('type')} {w.get('num_bits')}-bit weights, strategy {w.get('strategy')!r}, "
               f"actorder {w.get('actorder')!r}, format {scheme.get('format') or fmt!r}")
        if (w.get("num_bits") != 4 or w.get("type") != "int" or w.get("strategy") not in ("group", "channel")
                or scheme.get("input_activations") or (scheme.get("format") or fmt) != "pack-quantized"
                or w.get("actorder") not in (None, "weight", "static")):
            raise _refuse(CT, supported, f"config group {name!r}: {got}" +
                          (", activations quantized" if scheme.get("input_activations") else ""))
        if w.get("strategy") == "group":
            group_sizes.add(int(w["group_size"]))
    # (ignore and targets decide which weights the checkpoint packs: a weight_packed is read as
    # quantized, a weight as plain)
    return {"method": CT, "group_sizes": tuple(sorted(group_sizes))}


# -- the stored format --------------------------------------------------------------------------

def _nibbles(x: torch.Tensor) -> torch.Tensor:
    """int32 ``x`` [..., n] as its 4-bit values, uint8 [..., 8n]: element 8c + j is bits 4j of
    ``x[..., c]``. (Read as bytes on little-endian hosts, each byte two values: two passes over
    half a byte a weight instead of eight shifts over four.)"""
    if sys.byteorder == "little":
        b = x.contiguous()
        if b.stride(-1) != 1:  # (a last dim of one: contiguous() keeps any stride there)
            b = b.new_empty(b.shape).copy_(b)
        b = b.view(torch.uint8)
        return torch.stack((b & 15, b >> 4), -1).flatten(-2)
    return ((x.unsqueeze(-1) >> _SHIFTS.to(x.device)) & 15).to(torch.uint8).flatten(-2)


@dataclass(frozen=True)
class Int4Groups:
    """4-bit integers with per-group scales and zero points in ``method``'s layout (module
    docstring); ``group_size`` input columns per scale, ``columns`` the weight's in features."""

    method: str
    group_size: int
    columns: int
    zeros_minus_one: bool = False  # GPTQ v1

    @property
    def name(self) -> str:
        return f"{self.method}-int4"

    def ints(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | int, torch.Tensor]:
        """(q [..., out, in], zero [..., out, groups], scale [..., out, groups]) with
        ``W = (q - zero) * scale`` per group: q and zero unsigned 4-bit (uint8), the scales as stored."""
        if self.method == GPTQ:
            z = _nibbles(parts["qzeros"])
            if self.zeros_minus_one:
                z = (z + 1) & 15
            return _nibbles(parts["qweight"].mT), z.mT, parts["scales"].mT
        if self.method == AWQ:
            order = torch.tensor(AWQ_REVERSE, device=parts["qweight"].device)

            def columns(t):  # [..., rows, out/8] -> [..., out, rows]
                return _nibbles(t).unflatten(-1, (t.shape[-1], 8)).index_select(-1, order).flatten(-2).mT
            return columns(parts["qweight"]), columns(parts["qzeros"]), parts["scales"].mT
        # compressed-tensors stores q + 8 and zero + 8 (8: symmetric)
        q = _nibbles(parts["weight_packed"])[..., :self.columns]
        zp = parts.get("weight_zero_point")
        return q, 8 if zp is None else _nibbles(zp.mT)[..., :q.shape[-2]].mT, parts["weight_scale"]

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``(q - zero) * scale`` in float32 (exact: a 5-bit integer times an fp16 or bf16
        scale), then rounded once into ``dtype``."""
        q, z, s = self.ints(parts)
        w, n, groups = q.to(torch.float32), self.columns, s.shape[-1]
        if n == groups * self.group_size or groups == 1:  # whole groups: broadcast, in place
            g = w.unflatten(-1, (groups, n // groups))
            g.sub_(z if isinstance(z, int) else z.unsqueeze(-1)).mul_(s.unsqueeze(-1))
        else:  # a partial last group
            w.sub_(z if isinstance(z, int) else z.repeat_interleave(self.group_size, -1)[..., :n])
            w.mul_(s.float().repeat_interleave(self.group_size, -1)[..., :n])
        return w.to(dtype)

    def cuda_linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``x @ W.T`` by tinygemm on a CUDA device, else None (module docstring)."""
        n = self.columns
        if x.device.type != "cuda" or x.dtype != torch.bfloat16 or self.group_size not in (32, 64, 128, 256) \
                or n % self.group_size or n % 32:
            return None
        q, z, s = self.ints(parts)
        if q.dim() != 2 or q.shape[0] % 8:
            return None
        inner_k_tiles = 8 if n % 128 == 0 else 4 if n % 64 == 0 else 2  # (in features a multiple of 16 x tiles)
        packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), inner_k_tiles)
        scale = s.float()
        zero = (8 - (z if isinstance(z, int) else z.float())) * scale  # exact in float32, then rounded
        scale_and_zero = torch.stack((scale, zero), -1).to(torch.bfloat16).transpose(0, 1).contiguous()  # [G, O, 2]
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, n).contiguous(), packed, self.group_size, scale_and_zero)
        return y.reshape(*x.shape[:-1], q.shape[0])

    def dequantize_into(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """A few output rows at a time (every value is its own: the same bits). Out lies along
        dim -2 of compressed-tensors' parts and -1 of GPTQ's and AWQ's; zeros (and AWQ's weights)
        pack 8 of its rows in an int32."""
        packed = {"qzeros", "weight_zero_point"} | ({"qweight"} if self.method == AWQ else set())
        dim = -2 if self.method == CT else -1
        step = max(1, (1 << 18) // out.shape[-1] // 8) * 8
        dequantize_rows(self.dequantize, parts, out, {k: 8 if k in packed else 1 for k in parts}, step,
                        dict.fromkeys(parts, dim))

    def cat(self, parts_list: list[dict[str, torch.Tensor]], dim: int, shapes) -> dict[str, torch.Tensor] | None:
        """Joined along out (-2: transformers fuses gate and up projections so) where every
        piece but the last has whole int32s of zeros along out; not along in (None)."""
        if dim != -2 or any(shape[-2] % 8 for shape in shapes[:-1]):
            return None
        out_dim = -2 if self.method == CT else -1  # where out lies in the stored parts
        return {k: torch.cat([p[k] for p in parts_list], out_dim) for k in parts_list[0]}


# -- loading ------------------------------------------------------------------------------------

def to_stored(tensors: dict[str, torch.Tensor], params: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``tensors`` with each quantized weight and its companions replaced by one ``StoredWeight``
    under ``X.weight``, its parts as stored."""
    method = params["method"]
    packed, companions = "." + PACKED[method], companion_suffixes(method)
    out = {}
    for name in tensors:
        if name.endswith(packed):
            base = name[:-len(packed)]
            out[base + ".weight"] = stored_int4(method, base, tensors, params, dtype)
    for name, t in tensors.items():
        if name.endswith(packed):
            continue
        if name.endswith(companions):
            base = name.rsplit(".", 1)[0]
            if base + packed not in tensors:
                raise CheckpointError(f"{name} accompanies {base}{packed}, which is not in the checkpoint")
            continue
        out[name] = t
    return out


def _need(tensors: dict, name: str, why: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise CheckpointError(f"{name} is missing ({why})")
    return t


def stored_int4(method: str, base: str, tensors: dict[str, torch.Tensor], params: dict,
                dtype: torch.dtype) -> StoredWeight:
    """The ``StoredWeight`` of quantized linear ``base`` (its ``X.qweight`` etc. in ``tensors``)."""
    names = {p: f"{base}.{p}" for p in (*PARTS[method], *DROPPED[method])}
    packed = tensors[names[PACKED[method]]]
    if packed.dim() != 2:
        raise CheckpointError(f"{names[PACKED[method]]} must be 2-D, not {list(packed.shape)}")
    if method == CT:
        shape = _need(tensors, names["weight_shape"], "the weight's shape")
        out_f, in_f = (int(d) for d in shape.tolist())
        scale = _need(tensors, names["weight_scale"], "its group scales")
        zp = tensors.get(names["weight_zero_point"])
        want_packed = (out_f, math.ceil(in_f / 8))
        groups = scale.shape[-1] if scale.dim() == 2 else 0
        group_size = in_f if groups == 1 else next(
            (g for g in params["group_sizes"] if math.ceil(in_f / g) == groups), 0)
        want = {names["weight_packed"]: (packed, want_packed), names["weight_scale"]: (scale, (out_f, groups))}
        parts = {"weight_packed": packed, "weight_scale": scale}
        if zp is not None:  # asymmetric
            want[names["weight_zero_point"]] = (zp, (math.ceil(out_f / 8), groups))
            parts["weight_zero_point"] = zp
        zeros_minus_one = False
    else:
        zeros = _need(tensors, names["qzeros"], "its zero points")
        scale = _need(tensors, names["scales"], "its group scales")
        if method == GPTQ:
            in_f, out_f = packed.shape[0] * 8, packed.shape[1]
            want_packed = (in_f // 8, out_f)
        else:
            in_f, out_f = packed.shape[0], packed.shape[1] * 8
            want_packed = (in_f, out_f // 8)
        group_size = in_f if params["group_size"] == -1 else params["group_size"]
        groups = math.ceil(in_f / group_size)
        want = {names["qweight"]: (packed, want_packed), names["qzeros"]: (zeros, (groups, out_f // 8)),
                names["scales"]: (scale, (groups, out_f))}
        parts = {"qweight": packed, "qzeros": zeros, "scales": scale}
        zeros_minus_one = params.get("zeros_minus_one", False)
        if method == GPTQ and names["g_idx"] in tensors:
            g_idx = tensors[names["g_idx"]]
            if not torch.equal(g_idx.long(), torch.arange(in_f, device=g_idx.device) // group_size):
                raise CheckpointError(f"{names['g_idx']} permutes the groups (act-order, desc_act true): stored "
                                      "gptq is supported with a trivial g_idx (i // group_size) only")
    if not group_size:
        raise CheckpointError(f"{names['weight_scale']} has {groups} groups, which none of the configured "
                              f"group sizes {list(params['group_sizes'])} gives for {in_f} columns")
    for n, (t, shape) in want.items():
        if t is not scale and t.dtype != torch.int32:
            raise CheckpointError(f"{n} must be int32 (packed 4-bit values), not {str(t.dtype).removeprefix('torch.')}")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{n} has shape {list(t.shape)}, but a {out_f}x{in_f} weight in groups of "
                                  f"{group_size} needs {list(shape)}")
    fmt = Int4Groups(method, group_size, in_f, zeros_minus_one)
    return StoredWeight(fmt, parts, (out_f, in_f), dtype)


def held_bytes(name: str, info, dtype_bytes: int, params: dict) -> int:
    """Packed weights, zeros and scales at their stored size; a GPTQ g_idx and a
    compressed-tensors weight_shape nothing (read, then dropped); other tensors in the compute
    dtype."""
    method = params["method"]
    n = 1
    for d in info.shape:
        n *= d
    last = name.rsplit(".", 1)[-1]
    if last in DROPPED[method]:
        return 0
    if last in PARTS[method]:
        return n * _DTYPE_BYTES.get(info.dtype, dtype_bytes)
    return n * dtype_bytes
