"""Write a llama checkpoint as a GGUF file, quantized the way llama.cpp's converter stores it.

``convert_to_gguf(src, dst, "Q8_0" | "Q4_K")`` writes ``dst/model.gguf`` (gguf.GGUFWriter) and
copies the tokenizer files beside it (a GGUF checkpoint in shardnet is a directory holding one
.gguf and its tokenizer.json). As llama.cpp's ``convert_hf_to_gguf.py`` does: tensors are named
by gguf-py's tensor name map (``blk.N.attn_q.weight``...), llama's q and k projections are
stored with their rows permuted for llama.cpp's rope (``permute``), 1-D tensors (norms) are F32,
and the token embedding and output head are F16. Every 2-D weight of a decoder layer is stored
in the chosen type: Q8_0 through ``gguf.quants.quantize``; Q4_K (gguf-py has no Q4_K
quantizer) through ``quantize_q4_k``, a plain round-to-nearest encoder written here. A weight
whose rows are not whole Q4_K super-blocks (256 values) falls back to Q8_0, as llama.cpp falls
back to another type for such shapes. (A simplification of Q4_K_M, which also keeps some
tensors in Q6_K.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from shardnet.errors import CheckpointError

GGUF_FILE = "model.gguf"


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's converter's row order for q/k (``LlamaModel.permute``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[..., cols] float32 (cols a multiple of 256) -> [..., cols / 256 * 144] uint8 Q4_K blocks:
    per 32-value sub-block, scale (max - min) / 15 and min, both as 6-bit multiples of the super
    block's fp16 d and dmin; values rounded to the nearest of 16 levels."""
    lead, cols = x.shape[:-1], x.shape[-1]
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0)
    hi = sub.max(-1)
    scale, mins = (hi - lo) / 15, -lo
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.rint(scale / d.astype(np.float32)), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin > 0, np.rint(mins / dmin.astype(np.float32)), 0).clip(0, 63).astype(np.uint8)
        step = d.astype(np.float32) * sc
        q = np.where(step[..., None] > 0,
                     np.rint((sub + (dmin.astype(np.float32) * m)[..., None]) / step[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
                             (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=-1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], axis=-1)
    return out.reshape(*lead, cols // 256 * 144)


def convert_to_gguf(src: str | Path, dst: str | Path, qtype: str = "Q8_0") -> Path:
    """Write the llama checkpoint ``src`` (a safetensors directory) as ``dst/model.gguf`` with
    its decoder weights in ``qtype`` (``Q8_0`` or ``Q4_K``); returns ``dst``."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.torch import load_file
    from transformers import AutoConfig

    src, dst = Path(src), Path(dst)
    cfg = AutoConfig.from_pretrained(str(src), local_files_only=True)
    if cfg.model_type != "llama":
        raise CheckpointError(f"GGUF is written here for llama checkpoints only, not {cfg.model_type!r}")
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)
    w = gguf.GGUFWriter(str(dst / GGUF_FILE), "llama")
    w.add_name(src.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, value in (("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id), ("pad", cfg.pad_token_id)):
        if isinstance(value, int):
            getattr(w, f"add_{key}_token_id")(value)

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, t in tensors.items():
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(module)
        if gguf_name is None:
            raise CheckpointError(f"{hf_name} has no GGUF name")
        gguf_name += "." + suffix
        data = t.float().numpy()
        if ".attn_q." in gguf_name:
            data = permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif ".attn_k." in gguf_name:
            data = permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if data.ndim == 1:
            w.add_tensor(gguf_name, data.astype(np.float32))
        elif not gguf_name.startswith("blk."):
            w.add_tensor(gguf_name, data.astype(np.float16))
        elif qtype == "Q4_K" and data.shape[-1] % 256 == 0:
            w.add_tensor(gguf_name, quantize_q4_k(data), raw_dtype=T.Q4_K)
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(data, T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def convert_to_gguf_q8_0(src: str | Path, dst: str | Path) -> Path:
    return convert_to_gguf(src, dst, "Q8_0")


def convert_to_gguf_q4_k(src: str | Path, dst: str | Path) -> Path:
    return convert_to_gguf(src, dst, "Q4_K")


def transformers_gguf_model(directory: str | Path, dtype=torch.float32):
    """transformers' own load of the GGUF checkpoint in ``directory`` (it dequantizes every tensor)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=GGUF_FILE, dtype=dtype).eval()
