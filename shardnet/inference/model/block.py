"""Run a contiguous range of decoder layers with transformers' own classes.

Attention, MLP, norms and rotary embeddings are transformers' modules for the family; shardnet
only decides which layers live here, loads exactly their weights, builds the masks the family's
model would build, and keeps a block-local KV cache.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass

import torch

from shardnet.inference.model.checkpoint import Checkpoint, CheckpointError

log = logging.getLogger(__name__)

#: model_type -> (module, decoder layer, RMS norm, rotary embedding)
FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer", "LlamaRMSNorm", "LlamaRotaryEmbedding"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer", "MistralRMSNorm",
                "MistralRotaryEmbedding"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm", "Qwen2RotaryEmbedding"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm", "Qwen3RotaryEmbedding"),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def family_classes(model_type: str):
    mod_name, layer, norm, rotary = FAMILIES[model_type]
    mod = importlib.import_module(mod_name)
    return getattr(mod, layer), getattr(mod, norm), getattr(mod, rotary)


def pick_device(requested: str | None = None) -> str:
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})") from None


def parse_layers(spec: str, num_layers: int) -> tuple[int, int]:
    """'0:8' -> (0, 8); validated against the model."""
    try:
        a, b = spec.split(":")
        start, end = int(a or 0), int(b) if b else num_layers
    except ValueError:
        raise CheckpointError(f"layer range {spec!r} is not START:END") from None
    if not 0 <= start < end <= num_layers:
        raise CheckpointError(f"layer range {start}:{end} is outside the model's 0:{num_layers}")
    return start, end


@dataclass
class LoadReport:
    tensors: int
    bytes: int
    seconds: float


class Block:
    """Layers [start, end) of a checkpoint."""

    def __init__(self, ckpt: Checkpoint, start: int, end: int, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> None:
        if not 0 <= start < end <= ckpt.num_layers:
            raise CheckpointError(f"layer range {start}:{end} is outside the model's 0:{ckpt.num_layers}")
        self.ckpt, self.start, self.end = ckpt, start, end
        self.dtype, self.device = dtype, device
        self.config = ckpt.config
        layer_cls, _, rotary_cls = family_classes(ckpt.model_type)
        t0 = time.perf_counter()
        self.layers = torch.nn.ModuleList()
        n_tensors = n_bytes = 0
        for i in range(start, end):
            with torch.device("meta"):
                layer = layer_cls(self.config, layer_idx=i)  # global index: per-layer attention type
            layer.self_attn.layer_idx = i - start  # block-local index: this block's cache
            prefix = f"model.layers.{i}."
            tensors = ckpt.load(ckpt.layer_tensors(i), dtype=dtype, device=device)
            state = {n[len(prefix):]: t for n, t in tensors.items()}
            layer.load_state_dict(state, strict=True, assign=True)
            layer.eval()
            self.layers.append(layer)
            n_tensors += len(state)
            n_bytes += sum(t.numel() * t.element_size() for t in state.values())
            log.info("loaded layer %d (%d tensors)", i, len(state))
        self.rotary = rotary_cls(config=self.config).to(device)
        self.layer_types = [self._layer_type(i) for i in range(start, end)]
        self.load_report = LoadReport(n_tensors, n_bytes, time.perf_counter() - t0)

    def _layer_type(self, i: int) -> str:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[i]
        if self.ckpt.model_type == "mistral" and getattr(self.config, "sliding_window", None):
            return "sliding_attention"
        return "full_attention"

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def kv_bytes_per_token(self) -> int:
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return 2 * self.num_layers * kv_heads * head_dim * torch.tensor([], dtype=self.dtype).element_size()

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, cache, start_pos: int) -> torch.Tensor:
        """hidden: [batch, tokens, hidden_size] for positions start_pos.. ; updates ``cache``."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        hidden = hidden.to(device=self.device, dtype=self.dtype)
        t = hidden.shape[1]
        position_ids = torch.arange(start_pos, start_pos + t, device=self.device).unsqueeze(0)
        kw = dict(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=cache,
                  position_ids=position_ids)
        masks = {"full_attention": create_causal_mask(**kw)}
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        pos_emb = self.rotary(hidden, position_ids=position_ids)
        for layer, kind in zip(self.layers, self.layer_types):
            hidden = layer(hidden, attention_mask=masks[kind], position_ids=position_ids, cache=cache,
                           use_cache=True, position_embeddings=pos_emb)
        return hidden


class Head:
    """Embeddings, final norm and LM head: what the client holds by default."""

    def __init__(self, ckpt: Checkpoint, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 embed: bool = True, lm_head: bool = True) -> None:
        _, norm_cls, _ = family_classes(ckpt.model_type)
        names = ckpt.head_tensors()
        want = []
        if embed or names["lm_head"] is None:
            want.append(names["embed"])
        if lm_head:
            want.append(names["norm"])
            if names["lm_head"]:
                want.append(names["lm_head"])
        t = ckpt.load(want, dtype=dtype, device=device)
        self.dtype, self.device = dtype, device
        self.embed_weight = t.get(names["embed"])
        self.norm = None
        self.lm_weight = None
        if lm_head:
            cfg = ckpt.config
            self.norm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps).to(device=device, dtype=dtype)
            self.norm.weight.data.copy_(t[names["norm"]])
            self.lm_weight = t[names["lm_head"]] if names["lm_head"] else self.embed_weight
        if not embed:
            self.embed_weight = None if names["lm_head"] else self.embed_weight

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids.to(self.device), self.embed_weight)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[batch, tokens, hidden] -> [batch, tokens, vocab] in float32."""
        h = self.norm(hidden.to(device=self.device, dtype=self.dtype))
        return torch.nn.functional.linear(h, self.lm_weight).float()
