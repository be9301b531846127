"""Run a contiguous range of decoder layers with transformers' own modules.

Attention, MLP or experts, norms and rotary tables are the modules transformers builds for the
family (:mod:`shell`); shardnet only decides which layers live here, loads exactly their weights,
builds the masks the family's model would build, applies what its adapter declares
(:mod:`families`), and keeps a block-local KV cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from shardnet.inference.model.checkpoint import Checkpoint, CheckpointError
from shardnet.inference.model.shell import ModelShell

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: what ``--dtype`` accepts: a dtype, or "auto" for the one the checkpoint stores
DTYPE_CHOICES = ("auto", *DTYPES)


def pick_device(requested: str | None = None) -> str:
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str, ckpt: Checkpoint | None = None, device: str = "cpu") -> torch.dtype:
    """``name`` as a torch dtype; "auto" is the checkpoint's stored dtype, unless ``device``
    cannot compute in it (a GPU without bfloat16), where it is float32 and the log says so."""
    if name == "auto":
        if ckpt is None:
            raise CheckpointError("dtype 'auto' needs the checkpoint it is read from")
        dtype = DTYPES[ckpt.stored_dtype]
        if dtype == torch.bfloat16 and device.startswith("cuda") and not torch.cuda.is_bf16_supported(including_emulation=False):
            log.warning("%s has no bfloat16: computing %s in float32", device, ckpt.path.name)
            return torch.float32
        return dtype
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} (choose from {', '.join(DTYPE_CHOICES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


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
                 device: str = "cpu", quantize: str | None = None, config=None) -> None:
        """``config``: the checkpoint's own unless given (the family check shrinks windows)."""
        if not 0 <= start < end <= ckpt.num_layers:
            raise CheckpointError(f"layer range {start}:{end} is outside the model's 0:{ckpt.num_layers}")
        self.ckpt, self.start, self.end = ckpt, start, end
        self.dtype, self.device, self.quantize = dtype, device, quantize
        self.family = ckpt.family
        t0 = time.perf_counter()
        shell = ModelShell(ckpt, dtype, config)
        self.config = shell.config
        self.layers = torch.nn.ModuleList()
        n_tensors = n_bytes = 0
        for i in range(start, end):
            names = ckpt.layer_tensors(i)
            n_bytes += shell.load(names, device=device)
            layer = shell.take(shell.base.layers[i], f"model.layers.{i}.", device)
            # built with its global index (which picks its attention type, dense or sparse MLP);
            # its attention addresses this block's own cache, which starts at 0
            for sub in layer.modules():
                if "Attention" in type(sub).__name__ and isinstance(getattr(sub, "layer_idx", None), int):
                    sub.layer_idx = i - start
            if quantize:
                from shardnet.inference.model.quantize import quantize_module

                quantize_module(layer, quantize)
            self.layers.append(layer)
            n_tensors += len(names)
            log.info("loaded layer %d (%d tensors)", i, len(names))
        self.rotary = shell.take(shell.base.rotary_emb, "model.rotary_emb.", device).to(device)
        self.layer_types = self.family.layer_types(self.config)[start:end]
        self.load_report = LoadReport(n_tensors, n_bytes, time.perf_counter() - t0)
        self._kv_bytes: int | None = None

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def kv_bytes_per_token(self) -> int:
        """Bytes the KV cache of this block grows by per token, measured once on one token (so
        MLA's wider keys, per-layer head counts and any family's cache layout count as they are)."""
        if self._kv_bytes is None:
            cache = self.new_cache()
            self.forward(torch.zeros(1, 1, self.config.hidden_size, dtype=self.dtype), cache, 0)
            self._kv_bytes = cache_bytes(cache)
        return self._kv_bytes

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
        masks = {}
        if "full_attention" in self.layer_types:
            masks["full_attention"] = create_causal_mask(**kw)
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        pos_emb = self.family.position_embeddings(self.rotary, hidden, position_ids, self.layer_types)
        for layer, kind in zip(self.layers, self.layer_types):
            hidden = layer(hidden, attention_mask=masks[kind], position_ids=position_ids, cache=cache,
                           use_cache=True, position_embeddings=pos_emb[kind])
        return hidden


    @torch.inference_mode()
    def forward_batch(self, steps: list[tuple[torch.Tensor, object]]) -> list[torch.Tensor]:
        """Several sessions' steps as one forward pass: ``steps`` is (hidden [1, T_i, hidden_size],
        the session's own cache) each, every session at the position its cache has reached, with
        any T_i (prefill chunks next to single decode positions and verify chunks). Returns each
        session's output and extends each cache as ``forward`` would: results equal running the
        steps one at a time, within the dtype's tolerance.

        The sessions' caches are gathered into one, each row's past left-padded to the longest and
        its new tokens right-padded to the most; one mask per attention type says, per row, which
        keys are real, causal and (sliding layers) within the window, in the row's own positions."""
        from transformers import DynamicCache

        if len(steps) == 1:  # nothing to gather: the plain path, without the padding's overhead
            h, cache = steps[0]
            return [self.forward(h, cache, cache.get_seq_length())]
        lengths = [cache.get_seq_length() for _, cache in steps]
        news = [h.shape[1] for h, _ in steps]
        b, past, new = len(steps), max(lengths), max(news)
        hidden = torch.zeros(b, new, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for row, (h, _) in enumerate(steps):
            hidden[row, :news[row]] = h[0].to(device=self.device, dtype=self.dtype)
        batch_cache = DynamicCache()
        if past:
            for idx in range(self.num_layers):
                ks, vs = [], []
                for (_, cache), length in zip(steps, lengths):
                    layer = cache.layers[idx] if length else None
                    ks.append(self._left_pad(layer.keys if layer else None, past, steps, idx, "keys"))
                    vs.append(self._left_pad(layer.values if layer else None, past, steps, idx, "values"))
                batch_cache.update(torch.cat(ks), torch.cat(vs), idx)
        lengths_t = torch.tensor(lengths, device=self.device)
        news_t = torch.tensor(news, device=self.device)
        position_ids = lengths_t[:, None] + torch.arange(new, device=self.device)[None, :]
        masks = {kind: self._batch_mask(lengths_t, news_t, past, new, kind) for kind in set(self.layer_types)}
        pos_emb = self.family.position_embeddings(self.rotary, hidden, position_ids, self.layer_types)
        for layer, kind in zip(self.layers, self.layer_types):
            hidden = layer(hidden, attention_mask=masks[kind], position_ids=position_ids, cache=batch_cache,
                           use_cache=True, position_embeddings=pos_emb[kind])
        for row, (_, cache) in enumerate(steps):
            for idx in range(self.num_layers):
                layer = batch_cache.layers[idx]
                cache.update(layer.keys[row:row + 1, :, past:past + news[row]],
                             layer.values[row:row + 1, :, past:past + news[row]], idx)
        return [hidden[row:row + 1, :news[row]] for row in range(b)]

    def _left_pad(self, t: torch.Tensor | None, past: int, steps, idx: int, which: str) -> torch.Tensor:
        """One row's cached keys or values, zeros in front up to ``past`` positions."""
        if t is None:  # a session with nothing cached yet: shape from one that has
            like = next(getattr(c.layers[idx], which) for _, c in steps if c.get_seq_length())
            return like.new_zeros(1, *like.shape[1:-2], past, like.shape[-1])
        if t.shape[-2] == past:
            return t
        pad = t.new_zeros(*t.shape[:-2], past - t.shape[-2], t.shape[-1])
        return torch.cat([pad, t], dim=-2)

    def _batch_mask(self, lengths: torch.Tensor, news: torch.Tensor, past: int, new: int, kind: str):
        """[rows, 1, new, past + new]: which keys each row's query may see, in its own positions."""
        j = torch.arange(past + new, device=self.device)[None, :]
        in_past = j < past
        key_pos = torch.where(in_past, j - (past - lengths[:, None]), lengths[:, None] + (j - past))
        key_real = torch.where(in_past, j >= past - lengths[:, None], (j - past) < news[:, None])
        t = torch.arange(new, device=self.device)[None, :]
        q_pos = lengths[:, None] + t
        allowed = key_real[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None])
        window = getattr(self.config, "sliding_window", None)
        if kind == "sliding_attention" and window:
            allowed &= (q_pos[:, :, None] - key_pos[:, None, :]) < window
        # a padding query sees only itself (an all-masked row would give NaNs)
        padding_q = t >= news[:, None]
        allowed |= padding_q[:, :, None] & (j[:, None, :] == past + t[:, :, None])
        allowed = allowed[:, None]
        if getattr(self.config, "_attn_implementation", "sdpa") == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min)


def cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class Head:
    """Embeddings, final norm and LM head: what the client holds by default."""

    def __init__(self, ckpt: Checkpoint, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 embed: bool = True, lm_head: bool = True) -> None:
        shell = ModelShell(ckpt, dtype)
        self.config, self.family = shell.config, ckpt.family
        parts = ckpt.head_parts()
        tied = not parts["lm_head"]
        load_embed = embed or (lm_head and tied)
        want = parts["embed"] if load_embed else []
        if lm_head:
            want = want + parts["norm"] + parts["lm_head"]
        shell.load(want, device=device)
        self.dtype, self.device = dtype, device
        base = shell.base
        embed_module = shell.take(base.embed_tokens, "model.embed_tokens.", device) if load_embed else None
        self.embed_module = embed_module if embed else None
        self.embed_weight = embed_module.weight if embed_module is not None else None
        self.norm = self.lm_module = self.lm_weight = None
        if lm_head:
            self.norm = shell.take(base.norm, "model.norm.", device)
            self.lm_module = embed_module if tied else shell.take(shell.model.lm_head, "lm_head.", device)
            self.lm_weight = self.lm_module.weight
        if not embed and not tied:
            self.embed_weight = None

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_module(ids.to(self.device))
        return self.family.scale_embeddings(self.config, h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[batch, tokens, hidden] -> [batch, tokens, vocab] in float32."""
        h = self.norm(hidden.to(device=self.device, dtype=self.dtype))
        bias = getattr(self.lm_module, "bias", None) if self.lm_module is not self.embed_module else None
        logits = torch.nn.functional.linear(h, self.lm_weight, bias)
        return self.family.finish_logits(self.config, logits).float()
