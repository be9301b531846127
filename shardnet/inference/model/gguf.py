"""GGUF checkpoints (llama.cpp's format), kept in their stored quantization.

A GGUF checkpoint is one ``.gguf`` file: its header holds the model's metadata (architecture,
sizes, tokenizer) and where each tensor lies; the tensors follow, each in its own GGML type
(F32/F16/BF16 as they are, or block-quantized: Q8_0 is 32 int8 values and an fp16 scale per
block, Q4_K 256 4-bit values with 6-bit sub-block scales and mins per super-block). Rows of a
tensor are independent: a row is a whole number of blocks.

What shardnet reads of it goes through transformers' own GGUF support: the config from the
metadata (``load_gguf_checkpoint``, its ``GGUF_CONFIG_MAPPING``), the tensor names
(``get_gguf_hf_weights_map``: GGUF ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)
and the row order of llama's q/k projections (llama.cpp stores them permuted for its rope:
``LlamaTensorProcessor`` un-permutes them; here the same permutation moves the packed rows, so
the stored bytes stay stored). Each tensor is a ``TensorEntry`` with its byte range in the file
and a dtype ``GGUF_<TYPE>`` (e.g. ``GGUF_Q8_0``), so the manifest, the model ID and chunk hashes
work as for safetensors.

A quantized weight is loaded as a ``StoredWeight`` holding its raw blocks ([rows, bytes per row]
uint8) and dequantized per call (``GgufBlocks``; Q8_0 and Q4_K in torch, bit for bit what
``gguf.quants.dequantize`` gives; any other type gguf-py reads through gguf-py itself).
Only llama-architecture files are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardnet.errors import CheckpointError
from shardnet.inference.model.stored import StoredWeight, dequantize_rows

#: GGUF architectures read (``general.architecture``)
SUPPORTED_ARCHITECTURES = ("llama",)
#: dtype names of the tensors kept as they are (converted to the compute dtype when loaded)
DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPE_PREFIX = "GGUF_"
#: what a checkpoint's raw config declares (formats.FORMATS["gguf"])
QUANTIZATION_CONFIG = {"quant_method": "gguf"}
COMPANION_SUFFIXES = ()  # the scales live inside each block


def dtype_name(qtype) -> str:
    return DTYPE_PREFIX + qtype.name


def qtype_of(dtype: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[dtype.removeprefix(DTYPE_PREFIX)]


# -- the stored format (formats.py) -------------------------------------------------------------
def parse(q: dict) -> dict:
    return {}


def to_stored(tensors: dict[str, torch.Tensor], params: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Quantized weights (already ``StoredWeight``s, ``read_tensors``) take the compute dtype (a
    view of their blocks); the others pass unchanged."""
    return {n: t.to(dtype) if isinstance(t, StoredWeight) else t for n, t in tensors.items()}


def held_bytes(name: str, info, dtype_bytes: int, params: dict) -> int:
    """Quantized tensors at their stored size; F32/F16/BF16 ones in the compute dtype."""
    if info.dtype.removeprefix(DTYPE_PREFIX) in DENSE:
        return math.prod(info.shape) * dtype_bytes
    return info.size


@dataclass(frozen=True)
class GgufBlocks:
    """One GGML block-quantized type: part ``blocks`` [..., rows, bytes per row] uint8, each row
    ``cols / block_size`` blocks of ``type_size`` bytes."""

    qtype: int
    name = "gguf"

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(parts["blocks"], self.qtype).to(dtype)

    def dequantize_into(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """A few rows at a time (rows are independent: the same bits)."""
        dequantize_rows(self.dequantize, parts, out, {"blocks": 1}, max(1, (1 << 18) // out.shape[-1]))

    def cat(self, parts_list: list[dict[str, torch.Tensor]], dim: int, shapes) -> dict[str, torch.Tensor]:
        """Rows are independent and each row is whole blocks: joined along out or in as bytes."""
        return {"blocks": torch.cat([p["blocks"] for p in parts_list], dim)}


def dequantize(blocks: torch.Tensor, qtype) -> torch.Tensor:
    """[..., rows, bytes per row] GGML blocks of ``qtype`` -> [..., rows, cols] float32."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qtype = GGMLQuantizationType(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    lead = blocks.shape[:-1]
    flat = blocks.reshape(-1, type_size)
    if qtype == GGMLQuantizationType.Q8_0:
        out = _dequantize_q8_0(flat)
    elif qtype == GGMLQuantizationType.Q4_K:
        out = _dequantize_q4_k(flat)
    else:  # any other type gguf-py reads (Q6_K, Q5_K...): numpy, correct if not fast
        out = torch.from_numpy(gguf_dequantize(flat.cpu().numpy(), qtype)).to(blocks.device)
    return out.reshape(*lead, blocks.shape[-1] // type_size * block_size)


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 little-endian halves -> [n, 1] float32."""
    return two_bytes.contiguous().view(torch.float16).float()


def _dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    """[n, 34]: fp16 d, 32 int8 q; x = q * d (gguf-py's order of operations)."""
    d = _fp16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """[n, 144]: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
    128 bytes of 4-bit q (bytes 32g..32g+31 hold sub-block 2g low, 2g+1 high); x = d*sc*q - dmin*m."""
    n = b.shape[0]
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    s = b[:, 4:16].reshape(n, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()
    m = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1).float()
    scale = (d * sc).reshape(n, 8, 1)
    offset = (dmin * m).reshape(n, 8, 1)
    qs = b[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    return (scale * q - offset).reshape(n, 256)


# -- reading a .gguf file ----------------------------------------------------------------------
@dataclass
class GgufIndex:
    raw_config: dict
    #: checkpoint name -> (GGUF tensor name, TensorEntry)
    tensors: dict
    header_size: int  # bytes before the first tensor: the metadata and the tensor infos


def read_gguf(file: Path, entry_type) -> GgufIndex:
    """The config and the tensors of a llama GGUF file (``entry_type``: checkpoint.TensorEntry)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        reader = GGUFReader(file)
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise CheckpointError(f"{file} is not a readable GGUF file: {' '.join(str(e).split())[:200]}") from None
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{file.name}: GGUF architecture {arch!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    config = load_gguf_checkpoint(str(file), return_tensors=False)["config"]
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    names = _hf_names(config)
    tensors = {}
    for t in reader.tensors:
        hf = names.get(t.name)
        if hf is None:
            raise CheckpointError(f"{file.name}: GGUF tensor {t.name} has no place in the llama model "
                                  "transformers builds from its metadata")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        start = int(t.data_offset)
        tensors[hf] = (t.name, entry_type(file, dtype_name(t.tensor_type), shape, start, start + int(t.n_bytes)))
    return GgufIndex(config, tensors, int(reader.data_offset))


def read_gguf_header(header: Path, manifest: dict, entry_type) -> GgufIndex:
    """The config and tensor names of a GGUF file from its header alone (what a swarm-filled
    directory holds, ``manifest`` the model's): read as the whole file, its tensor data a hole of
    a sparse temporary file (gguf-py maps every tensor). The header must describe the manifest's
    tensors (dtype, shape, size)."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / manifest["gguf"][0]
        shutil.copyfile(header, whole)
        tensors = manifest["tensors"]
        with open(whole, "r+b") as fh:  # room for every tensor and its alignment padding, unwritten
            fh.truncate(header.stat().st_size + sum(v[2] for v in tensors.values()) + 64 * (len(tensors) + 1))
        index = read_gguf(whole, entry_type)
    for name, (gguf_name, e) in index.tensors.items():
        want = tensors.get(name)
        if want is None or (want[0], tuple(want[1]), want[2]) != (e.dtype, e.shape, e.size):
            raise CheckpointError(f"the GGUF header of {manifest['gguf'][0]} does not describe tensor {name} "
                                  "as its manifest does")
    if len(index.tensors) != len(tensors):
        raise CheckpointError(f"the GGUF header of {manifest['gguf'][0]} holds {len(index.tensors)} tensors, "
                              f"its manifest {len(tensors)}")
    return index


def _hf_names(config: dict) -> dict[str, str]:
    """GGUF tensor name -> transformers' name, as transformers' GGUF load maps them."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    processor = TENSOR_PROCESSORS.get("llama", TensorProcessor)(config=config)
    return get_gguf_hf_weights_map(model, processor)


def row_order(gguf_name: str, rows: int, config: dict) -> torch.Tensor | None:
    """The row permutation transformers' ``LlamaTensorProcessor`` undoes on q/k (rows of the
    stored tensor to take, in order), None for any other tensor."""
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is None or kv_heads is None:
        return None
    if ".attn_q." in gguf_name:
        n = heads
    elif ".attn_k." in gguf_name:
        n = kv_heads
    else:
        return None
    return torch.arange(rows).reshape(n, rows // n // 2, 2).transpose(1, 2).reshape(rows)


def read_tensors(index: GgufIndex, entries: dict, names: list[str], device: str) -> dict[str, torch.Tensor]:
    """``names`` read where ``entries`` (checkpoint.TensorEntry: the .gguf, or the safetensors
    groups of a swarm-filled directory) say: F32/F16/BF16 tensors as they are stored, quantized ones
    as a float32 ``StoredWeight`` of their blocks; llama's q/k rows put back in transformers' order."""
    from gguf import GGML_QUANT_SIZES

    out = {}
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(entries[n].file, []).append(n)
    for f, ns in by_file.items():
        with open(f, "rb") as fh:
            for n in ns:
                gguf_name, e = index.tensors[n][0], entries[n]
                fh.seek(e.start)
                raw = torch.frombuffer(bytearray(fh.read(e.size)), dtype=torch.uint8)
                kind = e.dtype.removeprefix(DTYPE_PREFIX)
                rows = math.prod(e.shape[:-1])
                data = raw.view(DENSE[kind]) if kind in DENSE else raw
                data = data.reshape(rows, -1)
                order = row_order(gguf_name, rows, index.raw_config)
                if order is not None:
                    data = data[order]
                if kind in DENSE:
                    t = data.reshape(e.shape)
                else:
                    qtype = qtype_of(e.dtype)
                    block_size, type_size = GGML_QUANT_SIZES[qtype]
                    if e.shape[-1] % block_size or data.shape[1] != e.shape[-1] // block_size * type_size:
                        raise CheckpointError(f"{gguf_name}: {list(e.shape)} does not fill whole {qtype.name} blocks")
                    t = StoredWeight(GgufBlocks(int(qtype)), {"blocks": data.reshape(*e.shape[:-1], -1).contiguous()},
                                     e.shape, torch.float32)
                out[n] = t.to(device) if device != "cpu" else t
    return out
