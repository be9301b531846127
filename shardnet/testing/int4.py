"""Write 4-bit group-quantized copies of a checkpoint, stored as GPTQ, AWQ and compressed-tensors
(pack-quantized) checkpoints ship, and the plain checkpoints they stand for.

Which tensors are quantized is what the FP8 writer quantizes (``shardnet.testing.fp8.quantized_names``:
the weights of a decoder layer's linear layers and experts; not norms, routers, the embedding or
the LM head), as GPTQModel, AutoAWQ and llm-compressor (``ignore: [lm_head]``) leave those.

- GPTQ and AWQ: their own packages quantize on a GPU only, so the values here are round-to-nearest
  group quantization (no calibration, no error compensation: not what GPTQ or AWQ would choose,
  but a valid checkpoint of their layout), packed into exactly their layouts
  (shardnet/inference/model/int4.py describes them) with the quantization_config their tools
  write. GPTQ follows GPTQ's ``Quantizer.find_params`` (range widened to include 0; symmetric:
  zero 8), AWQ AutoAWQ's ``pseudo_quantize_tensor`` (asymmetric min/max). An asymmetric GPTQ zero
  point is kept in 1..15: the v1 format stores ``zero - 1`` and readers disagree on a wrapped 0.
- compressed-tensors: the package's own quantizer and packer (``calculate_qparams`` over each
  group's min/max, ``PackedQuantizationCompressor.compress``) and its ``QuantizationConfig``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardnet.testing.checkpoint_copy import rewrite_checkpoint
from shardnet.testing.fp8 import quantized_names

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _group_minmax(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of ``w`` [out, in] over ``group_size`` columns (the last group partial)."""
    out_f, in_f = w.shape
    groups = -(-in_f // group_size)
    cols = [w[:, g * group_size:(g + 1) * group_size] for g in range(groups)]
    return torch.stack([c.amin(1) for c in cols], 1), torch.stack([c.amax(1) for c in cols], 1)


def _per_column(t: torch.Tensor, group_size: int, in_f: int) -> torch.Tensor:
    return t.repeat_interleave(group_size, 1)[:, :in_f]


def rtn_int4(w: torch.Tensor, group_size: int, style: str, sym: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit group quantization of ``w`` [out, in]: (q [out, in] in 0..15,
    zeros [out, groups] in 0..15, fp16 scales [out, groups]) with ``w ~ (q - zero) * scale``;
    ``style`` gptq or awq (module docstring)."""
    w = w.float()
    lo, hi = _group_minmax(w, group_size)
    if style == "gptq":
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = torch.where(lo < 0, -hi, lo)
        both_zero = (lo == 0) & (hi == 0)
        lo, hi = torch.where(both_zero, -1.0, lo), torch.where(both_zero, 1.0, hi)
        scale = (hi - lo) / 15
        zero = torch.full_like(scale, 8.0) if sym else torch.round(-lo / scale).clamp(1, 15)
    else:
        scale = (hi - lo).clamp(min=1e-5) / 15
        zero = torch.round(-lo / scale).clamp(0, 15)
    scale = scale.half()
    s, z = _per_column(scale.float(), group_size, w.shape[1]), _per_column(zero, group_size, w.shape[1])
    q = (torch.round(w / s) + z).clamp(0, 15)
    return q.to(torch.int32), zero.to(torch.int32), scale


def _pack8(t: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int ``t`` [rows, 8n] packed along its last dim: int32 [rows, n], bits 4j of int32 c
    holding column 8c + order[j]."""
    rows, cols = t.shape
    groups = t.reshape(rows, cols // 8, 8)[..., list(order)].to(torch.int64)
    word = sum(groups[..., j] << (4 * j) for j in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()


def gptq_tensors(w: torch.Tensor, group_size: int, sym: bool) -> dict[str, torch.Tensor]:
    """GPTQ v1's ``qweight``, ``qzeros`` (zero - 1), ``scales``, ``g_idx`` of ``w`` [out, in]."""
    q, zero, scale = rtn_int4(w, group_size, "gptq", sym)
    in_f = w.shape[1]
    return {"qweight": _pack8(q).T.contiguous(),  # [in/8, out]: packed along in
            "qzeros": _pack8((zero.T - 1) & 15),
            "scales": scale.T.contiguous(),
            "g_idx": torch.arange(in_f, dtype=torch.int32) // group_size}


def awq_tensors(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AWQ gemm's ``qweight`` [in, out/8], ``qzeros``, ``scales`` of ``w`` [out, in]."""
    q, zero, scale = rtn_int4(w, group_size, "awq")
    return {"qweight": _pack8(q.T.contiguous(), AWQ_ORDER), "qzeros": _pack8(zero.T.contiguous(), AWQ_ORDER),
            "scales": scale.T.contiguous()}


def ct_scheme(group_size: int | None, symmetric: bool = True):
    """compressed-tensors' W4A16 scheme: int4 weights in groups (``group_size`` None: channel)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric,
                            strategy="channel" if group_size is None else "group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_tensors(w: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    """compressed-tensors' own quantization and packing of ``w`` [out, in]."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    gs = scheme.weights.group_size or w.shape[1]
    lo, hi = _group_minmax(w, gs)
    scale, zero = calculate_qparams(lo, hi, scheme.weights)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def _write(src: str | Path, dst: str | Path, quantize, quantization_config: dict, lm_head: bool = False) -> Path:
    from safetensors import safe_open
    from transformers import AutoConfig

    src = Path(src)
    names = [n for f in sorted(src.glob("*.safetensors")) for n in safe_open(str(f), "pt").keys()]
    chosen = quantized_names(names, AutoConfig.from_pretrained(str(src), local_files_only=True))
    if lm_head:  # (an untied one)
        chosen.add("lm_head.weight")

    def convert(name, t, _):
        if name in chosen and t.dim() == 2:
            base = name[:-len(".weight")]
            return {f"{base}.{k}": v for k, v in quantize(t).items()}
        return {name: t}

    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    return rewrite_checkpoint(src, dst, convert, config)


def write_gptq(src: str | Path, dst: str | Path, group_size: int = 32, sym: bool = True, lm_head: bool = False
               ) -> Path:
    """``src``'s GPTQ (v1, 4-bit, no act-order) copy at ``dst``, as GPTQModel writes its config
    (``lm_head``: the LM head quantized too, as GPTQModel's ``lm_head=True``)."""
    return _write(src, dst, lambda w: gptq_tensors(w, group_size, sym), {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": sym,
        "static_groups": False, "true_sequential": True, "lm_head": lm_head, "damp_percent": 0.01,
        "checkpoint_format": "gptq", "pack_dtype": "int32",
        "meta": {"quantizer": ["shardnet round-to-nearest (shardnet.testing.int4)"]}}, lm_head)


def write_awq(src: str | Path, dst: str | Path, group_size: int = 32) -> Path:
    """``src``'s AWQ (gemm, 4-bit, zero point) copy at ``dst``, as AutoAWQ writes its config."""
    return _write(src, dst, lambda w: awq_tensors(w, group_size), {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None})


def write_compressed_tensors(src: str | Path, dst: str | Path, group_size: int | None = 32,
                             symmetric: bool = True) -> Path:
    """``src``'s compressed-tensors pack-quantized W4A16 copy at ``dst`` (``group_size`` None:
    one scale per output channel), its config as llm-compressor writes it."""
    from compressed_tensors.quantization import QuantizationConfig

    scheme = ct_scheme(group_size, symmetric)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status="compressed", ignore=["lm_head"]).to_dict()
    config["quant_method"] = "compressed-tensors"
    return _write(src, dst, lambda w: ct_tensors(w, scheme), json.loads(json.dumps(config, default=str)))


def _unpack8(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """Written apart from shardnet's loader: int32 [rows, n] -> the 4-bit values [rows, 8n],
    column 8c + order[j] from bits 4j of int32 c."""
    rows, n = packed.shape
    out = torch.empty(rows, n * 8, dtype=torch.int64)
    for j in range(8):
        out[:, order[j]::8] = (packed.to(torch.int64) >> (4 * j)) & 15
    return out


def dequantized_int4_weight(parts: dict[str, torch.Tensor], method: str, group_size: int, scheme=None
                            ) -> torch.Tensor:
    """The float32 weight [out, in] one quantized linear's ``parts`` stand for (a reference:
    GPTQ and AWQ read out nibble by nibble; compressed-tensors by its own decompressor)."""
    if method == "compressed-tensors":
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

        return PackedQuantizationCompressor.decompress(dict(parts), scheme)["weight"].float()
    if method == "gptq":
        q = _unpack8(parts["qweight"].T.contiguous()).T  # [in, out]
        zero = (_unpack8(parts["qzeros"]) + 1) & 15  # v1: zero - 1 stored
    else:
        q = _unpack8(parts["qweight"], AWQ_ORDER)
        zero = _unpack8(parts["qzeros"], AWQ_ORDER)
    in_f = q.shape[0]
    g = torch.arange(in_f) // group_size
    return ((q - zero[g]).float() * parts["scales"].float()[g]).T.contiguous()


def int4_dequantized_reference(int4_dir: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The unquantized checkpoint a GPTQ, AWQ or compressed-tensors copy stands for: every
    quantized weight dequantized into ``dtype``, its parts and ``quantization_config`` dropped."""
    int4_dir = Path(int4_dir)
    config = json.loads((int4_dir / "config.json").read_text())
    qc = config.pop("quantization_config")
    method = qc["quant_method"]
    scheme = None
    if method == "compressed-tensors":
        from compressed_tensors.quantization import QuantizationScheme

        scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
        packed_name, companions = "weight_packed", ("weight_scale", "weight_shape", "weight_zero_point")
    else:
        packed_name, companions = "qweight", ("qzeros", "scales", "g_idx")

    def convert(name, t, tensors):
        base, _, last = name.rpartition(".")
        if last in companions:
            return {}
        if last == packed_name:
            parts = {k: tensors[f"{base}.{k}"] for k in (packed_name, *companions) if f"{base}.{k}" in tensors}
            return {base + ".weight": dequantized_int4_weight(parts, method, qc.get("group_size"), scheme).to(dtype)}
        return {name: t}

    return rewrite_checkpoint(int4_dir, dst, convert, config)