"""Run a contiguous range of decoder layers with transformers' own modules.

Attention, MLP or experts, norms and rotary tables are the modules transformers builds for the
family (:mod:`shell`); shardnet only decides which layers live here, loads exactly their weights,
builds the masks the family's model would build, applies what its adapter declares
(:mod:`families`), and keeps a block-local KV cache.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

import torch

from shardnet.inference.model.checkpoint import Checkpoint, CheckpointError
from shardnet.inference.model.kv_cache import (
    LayerKvShape,
    Rows,
    RowsKv,
    SessionKv,
    TransformedCache,
    rows_context,
    rowwise_attention,
)
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
        #: per layer, its modules whose ``layer_idx`` addresses the session's cache
        self._indexed: list[list[torch.nn.Module]] = []
        n_tensors = n_bytes = 0
        for i in range(start, end):
            names = ckpt.layer_tensors(i)
            n_bytes += shell.load(names, device=device)
            layer = shell.take(shell.base.layers[i], f"model.layers.{i}.", device)
            # built with its global index (which picks its attention type, dense or sparse MLP);
            # its attention addresses this block's own cache, which starts at 0
            indexed = [sub for sub in layer.modules()
                       if "Attention" in type(sub).__name__ and isinstance(getattr(sub, "layer_idx", None), int)]
            for sub in indexed:
                sub.layer_idx = i - start
            self._indexed.append(indexed)
            if quantize:
                from shardnet.inference.model.quantize import quantize_module

                quantize_module(layer, quantize)
            self.layers.append(layer)
            n_tensors += len(names)
            log.info("loaded layer %d (%d tensors)", i, len(names))
        self.rotary = shell.take(shell.base.rotary_emb, "model.rotary_emb.", device).to(device)
        self.layer_types = self.family.layer_types(self.config)[start:end]
        self.load_report = LoadReport(n_tensors, n_bytes, time.perf_counter() - t0)
        self._kv_layout: list[LayerKvShape | None] | None = None
        #: one forward pass at a time (a batched pass swaps the attention implementation)
        self._pass = threading.Lock()
        #: the configs the attention modules read their implementation from, and what it is
        self._attn_configs = list({id(m.config): m.config for layer in self.layers for m in layer.modules()
                                   if "Attention" in type(m).__name__ and hasattr(m, "config")}.values())
        self._attn_inner = self.config._attn_implementation or "eager"
        #: layers whose attention runs row by row in a batched step (kv_cache.TransformedCache)
        self._rowwise_layers: set[int] = set()

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def kv_layout(self) -> list[LayerKvShape | None]:
        """Per layer, the shape and dtype of one token's cached keys and values, measured once by a
        forward on one token (so MLA's wider keys, per-layer head counts and any family's cache
        layout count as they are); None for a layer that caches nothing."""
        if self._kv_layout is None:
            from transformers import DynamicCache

            probe = DynamicCache()
            self.forward(torch.zeros(1, 1, self.config.hidden_size, dtype=self.dtype), probe, 0)
            layout: list[LayerKvShape | None] = []
            for idx in range(self.num_layers):
                layer = probe.layers[idx] if idx < len(probe.layers) else None
                k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
                if not isinstance(k, torch.Tensor) or k.numel() == 0:
                    layout.append(None)
                    continue
                layout.append(LayerKvShape((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), k.dtype))
            self._kv_layout = layout
        return self._kv_layout

    def kv_bytes_per_token(self, layers: tuple[int, int] | None = None) -> int:
        """Bytes a session's KV cache on this block holds per position (what ``new_cache`` allocates
        per position of its length); ``layers``: of a session that runs only those (``forward``)."""
        i0, i1 = self.local_range(layers)
        return sum(s.bytes_per_token for s in self.kv_layout()[i0:i1] if s is not None)

    def local_range(self, layers: tuple[int, int] | None) -> tuple[int, int]:
        """``layers`` (model layer indices [a, b), within this block's; None: all of them) as
        indices into ``self.layers``; ValueError where they are not a non-empty part of it."""
        if layers is None:
            return 0, self.num_layers
        a, b = layers
        if not self.start <= a < b <= self.end:
            raise ValueError(f"layers {a}:{b} are not within this block's {self.start}:{self.end}")
        return a - self.start, b - self.start

    @property
    def takes_trees(self) -> bool:
        """Whether ``forward`` runs tree steps here: a family proven with trees, full attention."""
        return self.family.trees and "sliding_attention" not in self.layer_types

    def new_cache(self, max_len: int | None = None, layers: tuple[int, int] | None = None) -> SessionKv:
        """A session's KV cache: ``max_len`` positions allocated now, written in place by its
        steps (without a length it grows by doubling: local use, not a peer's served path);
        ``layers``: for a session that runs only those of the block (``forward``), theirs alone."""
        i0, i1 = self.local_range(layers)
        return SessionKv(self.kv_layout()[i0:i1], max_len, self.device)

    @contextlib.contextmanager
    def _addressing(self, i0: int):
        """While a sub-span's pass runs (its layers from ``self.layers[i0]``), each of its attention
        modules addresses the sub-span's own cache (index from its first layer, not the block's)."""
        if i0 == 0:
            yield
            return
        for i, modules in enumerate(self._indexed):
            for m in modules:
                m.layer_idx = i - i0
        try:
            yield
        finally:
            for i, modules in enumerate(self._indexed):
                for m in modules:
                    m.layer_idx = i

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, cache, start_pos: int, tree: list[int] | None = None,
                layers: tuple[int, int] | None = None) -> torch.Tensor:
        """hidden: [batch, tokens, hidden_size] for positions start_pos.. ; updates ``cache``.

        ``layers``: run only model layers [a, b) of this block's (a *sub-span* session: a chain
        that enters or leaves this peer's span in its middle); ``cache`` is then one made for
        exactly those (``new_cache(layers=...)``). The result is what a block of exactly those
        layers computes.

        ``tree``: the new tokens form a tree of drafts rather than a sequence: ``tree[i]`` is the
        index of token i's parent among them (-1: its parent is the cached text), parents before
        children. Token i then sits at position ``start_pos`` + its depth and attends to the
        cached positions and its ancestors alone, so its output is what the sequence from the
        root to it would give; the cache holds every token of the tree after the step, in the
        given order, until ``SessionKv.keep`` keeps the accepted path. Full attention only (a
        sliding window counts storage positions, not the tree's)."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        i0, i1 = self.local_range(layers)
        kinds = self.layer_types[i0:i1]
        if len(getattr(cache, "layers", ())) not in (0, i1 - i0):
            raise ValueError(f"a cache of {len(cache.layers)} layers for a pass over {i1 - i0}")
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        t = hidden.shape[1]
        position_ids = torch.arange(start_pos, start_pos + t, device=self.device).unsqueeze(0)
        kw = dict(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=cache,
                  position_ids=position_ids)
        if tree is not None:
            if "sliding_attention" in kinds:
                raise ValueError("a tree step needs full attention in every layer")
            depths, ancestors = tree_shape(tree, t)
            ancestors = ancestors.to(self.device)
            last = t - 1

            def in_tree(batch_idx, head_idx, q_idx, kv_idx):  # (storage indices: cached, then the tree's)
                q, kv = (q_idx - start_pos).clamp(0, last), (kv_idx - start_pos).clamp(0, last)
                return (kv_idx < start_pos) | ancestors[q, kv]

            kw["and_mask_function"] = in_tree  # the masks use storage order; rotary uses the depths
            position_ids = (start_pos + depths.to(self.device)).unsqueeze(0)
        masks = {}
        if tree is not None and self.config._attn_implementation == "sdpa":
            # the mask sdpa takes, built at once ([1, 1, t, cached + t] bool, True: attends); through
            # create_causal_mask, the tree's mask function costs ~2 ms a pass (vmap) on this CPU
            allowed = torch.ones(t, start_pos + t, dtype=torch.bool, device=self.device)
            allowed[:, start_pos:] = ancestors
            masks["full_attention"] = allowed[None, None]
        elif "full_attention" in kinds:
            masks["full_attention"] = create_causal_mask(**kw)
        if "sliding_attention" in kinds:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        pos_emb = self.family.position_embeddings(self.rotary, hidden, position_ids, kinds)
        with self._pass, self._addressing(i0):
            for layer, kind in zip(self.layers[i0:i1], kinds):
                hidden = layer(hidden, attention_mask=masks[kind], position_ids=position_ids, cache=cache,
                               use_cache=True, position_embeddings=pos_emb[kind])
        return hidden

    @torch.inference_mode()
    def forward_batch(self, steps: list[tuple[torch.Tensor, SessionKv]]) -> list[torch.Tensor]:
        """Several sessions' steps as one forward pass: ``steps`` is (hidden [1, T_i, hidden_size],
        the session's own cache) each, every session at the position its cache has reached, with
        any T_i (prefill chunks next to single decode positions and verify chunks). Returns each
        session's output and extends each cache as ``forward`` would: results equal running the
        steps one at a time, within the dtype's tolerance.

        Projections, norms and MLP run on the rows padded to the most new positions; each row's
        keys and values are written into its own cache and attention runs per row over that cache
        where it lies (kv_cache.rows_attention): no session's past is copied."""
        if len(steps) == 1:  # the plain path, without the padding
            h, cache = steps[0]
            return [self.forward(h, cache, cache.get_seq_length())]
        if any(len(cache.layers) != self.num_layers for _, cache in steps):
            raise ValueError("a sub-span session's steps run alone (forward with its layers), not batched")
        lengths = [cache.get_seq_length() for _, cache in steps]
        news = [h.shape[1] for h, _ in steps]
        b, new = len(steps), max(news)
        hidden = torch.zeros(b, new, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for row, (h, _) in enumerate(steps):
            hidden[row, :news[row]] = h[0].to(device=self.device, dtype=self.dtype)
        position_ids = (torch.tensor(lengths, device=self.device)[:, None]
                        + torch.arange(new, device=self.device)[None, :])
        pos_emb = self.family.position_embeddings(self.rotary, hidden, position_ids, self.layer_types)
        caches = [cache for _, cache in steps]
        while True:
            rows = Rows(caches, lengths, news, list(self.layer_types), getattr(self.config, "sliding_window", None),
                        self._attn_inner, self.dtype, rowwise=frozenset(self._rowwise_layers))
            try:
                out = self._batched_pass(hidden, position_ids, pos_emb, rows)
            except TransformedCache as e:  # learnt once per block: rewind, run that layer row by row
                if e.idx in self._rowwise_layers:
                    raise
                for cache, length in zip(caches, lengths):
                    cache.crop(length - cache.get_seq_length())
                self._rowwise_layers.add(e.idx)
                continue
            return [out[row:row + 1, :news[row]] for row in range(b)]

    def _batched_pass(self, hidden, position_ids, pos_emb, rows: Rows) -> torch.Tensor:
        batch_cache = RowsKv(rows, self.num_layers)
        with self._pass, rows_context(self._attn_configs, rows):
            for idx, (layer, kind) in enumerate(zip(self.layers, self.layer_types)):
                with (rowwise_attention(self._attention_of(layer), rows, idx) if idx in rows.rowwise
                      else contextlib.nullcontext()):
                    hidden = layer(hidden, attention_mask=None, position_ids=position_ids, cache=batch_cache,
                                   use_cache=True, position_embeddings=pos_emb[kind])
                if rows.unread:  # its attention read something other than the rows' caches
                    raise TransformedCache(min(rows.unread))
        return hidden

    @staticmethod
    def _attention_of(layer):
        found = [m for _, m in layer.named_children() if "Attention" in type(m).__name__]
        if len(found) != 1:
            raise CheckpointError(f"{type(layer).__name__} has no one attention module shardnet can find")
        return found[0]


def tree_shape(parents: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree of ``tokens`` drafts given as parent indices (-1: the cached text; parents before
    children): each token's depth (0 for the root's children), and which tokens are ancestors
    of which ([tokens, tokens] bool, row i: token i's ancestors and itself)."""
    if len(parents) != tokens:
        raise ValueError(f"a tree of {len(parents)} parents for {tokens} tokens")
    depths = torch.zeros(tokens, dtype=torch.long)
    ancestors = torch.eye(tokens, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"token {i}'s parent {p} is not an earlier token (or -1)")
        if p >= 0:
            depths[i] = depths[p] + 1
            ancestors[i] |= ancestors[p]
    return depths, ancestors


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
