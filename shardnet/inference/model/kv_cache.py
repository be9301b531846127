"""A block's KV cache kept where it is written: no step copies any session's past keys or values.

Each session's cache (:class:`SessionKv`) holds, per layer, one key and one value tensor allocated
once at the session's full length (``max_len`` positions: exactly what its KV budget reserves).
A step writes its new positions in place; attention reads a view of the positions written so far;
a rollback after rejected drafts only moves the length back; a session that ends drops its tensors
at once (:meth:`SessionKv.release`). transformers' attention modules see an ordinary ``Cache``.

A batched step (``Block.forward_batch``) runs the projections, norms and MLP of every session's
new positions as one padded batch; its cache (:class:`RowsKv`) writes each row's new keys and
values into that row's own session cache, and attention runs per row over the row's own cache
where it lies (:func:`rows_attention`, registered with transformers' ``AttentionInterface``),
calling the family's own attention function (sdpa or the family's eager one, with its softcaps
and sinks) with that row's causal (and sliding-window) mask. Nothing is gathered or padded in
the KV dimension. On a device with a paged-attention kernel the per-row loop is where it would go
(docs/performance.md says what has run: CPU only).

A cache made without a length (local sessions, the family check) grows by doubling: amortised
copies, never on a peer's served path, which always knows ``max_len``.
"""

from __future__ import annotations

import contextvars
import sys
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

#: the attention implementation name a batched step runs under (see ``rows_attention``)
ROWS_ATTENTION = "shardnet_rows"
#: first length of a cache made without one (it then doubles)
GROWING_START = 256


@dataclass(frozen=True)
class LayerKvShape:
    """Per token, one layer's cached keys and values: (heads, head_dim) each, and their dtype."""

    key: tuple[int, int]
    value: tuple[int, int]
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return size * (self.key[0] * self.key[1] + self.value[0] * self.value[1])


class SlabLayer(CacheLayerMixin):
    """One layer of a session's cache: keys and values [1, heads, capacity, dim], filled in place."""

    is_sliding = False  # every position is kept; sliding windows are the masks' business
    is_croppable = True
    is_compileable = False

    def __init__(self, shape: LayerKvShape, capacity: int | None, device) -> None:  # noqa: no super(): keys is a view
        self.shape, self.device = shape, device
        self.growing = capacity is None
        self.length = 0
        self._alloc(GROWING_START if capacity is None else capacity)
        self.is_initialized = True

    def _alloc(self, capacity: int) -> None:
        (hk, dk), (hv, dv) = self.shape.key, self.shape.value
        self._k = torch.empty(1, hk, capacity, dk, dtype=self.shape.dtype, device=self.device)
        self._v = torch.empty(1, hv, capacity, dv, dtype=self.shape.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, :, :self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, :self.length]

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated at construction
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new positions after those cached; return views of every cached position."""
        self.write(key_states, value_states)
        return self.keys, self.values

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            if self._k is None:
                raise RuntimeError("this session's KV cache was released")
            if not self.growing:
                raise ValueError(f"{end} positions exceed this KV cache's {self.capacity}")
            old_k, old_v = self.keys, self.values
            self._alloc(max(end, 2 * self.capacity))
            self._k[:, :, :self.length] = old_k
            self._v[:, :, :self.length] = old_v
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1 if self.growing else self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the number of positions to remove, negated")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    def release(self) -> None:
        self._k = self._v = None
        self.length = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._k is None else self._k.nbytes + self._v.nbytes


class SessionKv(Cache):
    """One session's KV cache on a block: a :class:`SlabLayer` per layer that has keys and values
    (a layer without them, as the probe found, gets transformers' own dynamic layer)."""

    def __init__(self, shapes: list[LayerKvShape | None], capacity: int | None, device) -> None:
        super().__init__(layers=[SlabLayer(s, capacity, device) if s is not None else DynamicLayer()
                                 for s in shapes])

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds (allocated, not only written)."""
        return sum(layer.nbytes for layer in self.layers if isinstance(layer, SlabLayer))

    def copy_positions(self, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer, a copy of the keys and values of positions [start, end) (a prefix page)."""
        return [(layer._k[:, :, start:end].clone(), layer._v[:, :, start:end].clone())
                if isinstance(layer, SlabLayer) else None for layer in self.layers]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write keys and values copied by ``copy_positions`` after the cached positions."""
        for layer, part in zip(self.layers, kv):
            if part is not None:
                layer.write(*part)

    def release(self) -> None:
        """Free the memory now (the session ended); the cache is unusable after."""
        for layer in self.layers:
            if isinstance(layer, SlabLayer):
                layer.release()

    def keep(self, start: int, indices: list[int]) -> None:
        """After a tree step written from ``start``: keep the positions ``start + i`` for ``i`` in
        ``indices`` (the accepted path, in order) as positions ``start``, ``start + 1``, ..., and
        forget the rest (``Block.forward``'s ``tree``)."""
        if sorted(set(indices)) != list(indices) or (indices and indices[0] < 0):
            raise ValueError(f"tree positions to keep must increase: {indices}")
        for layer in self.layers:
            if isinstance(layer, SlabLayer):
                if indices and start + indices[-1] >= layer.length:
                    raise ValueError(f"position {start + indices[-1]} is past the {layer.length} cached")
                idx = torch.tensor(indices, dtype=torch.long, device=layer._k.device) + start
                n = len(indices)
                layer._k[:, :, start:start + n] = layer._k[:, :, idx]  # (advanced indexing copies first)
                layer._v[:, :, start:start + n] = layer._v[:, :, idx]
                layer.length = start + n
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                idx = torch.tensor(indices, dtype=torch.long, device=layer.keys.device) + start
                layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, idx]], dim=-2)
                layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, idx]], dim=-2)


# -- a batched step --------------------------------------------------------------------------------
@dataclass
class Rows:
    """What a batched step's attention needs: per row, its session's cache, its cached length
    before the step and its number of new positions."""

    caches: list[SessionKv]
    lengths: list[int]
    news: list[int]
    layer_types: list[str]
    window: int | None
    inner: str  # the attention implementation the family runs under ("sdpa", "eager", ...)
    dtype: torch.dtype
    #: layers whose attention module transforms what the cache returns before attention (MLA
    #: expands its latent cache): their attention module runs row by row (``rowwise_attention``)
    rowwise: frozenset[int] = frozenset()
    #: per layer index, per row: (keys, values) views after this step's write
    views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    #: per layer index: what the batch cache's update returned (``rows_attention`` checks it is
    #: what reaches attention)
    returned: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: layers whose cache was written but whose attention did not go through ``rows_attention``
    #: (a module computing attention itself): ``Block.forward_batch`` runs them row by row
    unread: set[int] = field(default_factory=set)
    _masks: dict[tuple[int, str], torch.Tensor | None] = field(default_factory=dict)

    def mask(self, row: int, kind: str, device) -> torch.Tensor | None:
        """[1, 1, new, past + new] for ``row``: causal in its own positions, within the window on
        sliding layers; None where every key is visible to the single query."""
        key = (row, kind)
        if key not in self._masks:
            past, new = self.lengths[row], self.news[row]
            total = past + new
            sliding = kind == "sliding_attention" and self.window
            if new == 1 and not (sliding and total > self.window):
                self._masks[key] = None
            else:
                q = torch.arange(past, total, device=device)[:, None]
                k = torch.arange(total, device=device)[None, :]
                allowed = k <= q
                if sliding:
                    allowed &= (q - k) < self.window
                allowed = allowed[None, None]
                self._masks[key] = allowed if self.inner == "sdpa" else torch.zeros(
                    allowed.shape, dtype=self.dtype, device=device).masked_fill(~allowed, torch.finfo(self.dtype).min)
        return self._masks[key]


_ROWS: contextvars.ContextVar[Rows | None] = contextvars.ContextVar("shardnet_rows", default=None)


class _RowsLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, rows: Rows, idx: int) -> None:  # noqa: no super(): nothing of its own is stored
        self.rows, self.idx = rows, idx
        self.is_initialized = True
        self.keys = self.values = None

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Each row's real new positions go into its own session's cache; attention reads them
        there (``rows_attention``). Returns the new states as given."""
        views = []
        for row, (cache, new) in enumerate(zip(self.rows.caches, self.rows.news)):
            layer = cache.layers[self.idx]
            views.append(layer.update(key_states[row:row + 1, :, :new], value_states[row:row + 1, :, :new]))
        self.rows.views[self.idx] = views
        self.rows.returned[self.idx] = (key_states, value_states)
        self.rows.unread.add(self.idx)  # until rows_attention reads the views
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class RowsKv(Cache):
    """The cache a batched step's layers see (see the module docstring)."""

    def __init__(self, rows: Rows, num_layers: int) -> None:
        super().__init__(layers=[_RowsLayer(rows, i) for i in range(num_layers)])
        self.rows = rows


def rows_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention of a batched step, row by row over each row's own cache, with the family's own
    attention function. query [rows, heads, new, dim] -> [rows, new, heads, v_dim]."""
    rows = _ROWS.get()
    if rows is None:
        raise RuntimeError(f"{ROWS_ATTENTION} attention runs only inside Block.forward_batch")
    idx = module.layer_idx
    inner = _inner_attention(module, rows.inner)
    if idx in rows.rowwise:  # one row's module call (rowwise_attention): its own cache, its mask
        return inner(module, query, key, value, attention_mask, **kwargs)
    returned = rows.returned.get(idx, (None, None))
    if key is not returned[0] or value is not returned[1]:
        raise TransformedCache(idx)
    rows.unread.discard(idx)
    kind = rows.layer_types[idx]
    out = None
    for row, (k, v) in enumerate(rows.views[idx]):
        new = rows.news[row]
        o, _ = inner(module, query[row:row + 1, :, :new], k, v, rows.mask(row, kind, query.device), **kwargs)
        if out is None:
            out = o.new_zeros(query.shape[0], query.shape[2], *o.shape[2:])
        out[row, :new] = o[0]
    return out, None


class TransformedCache(Exception):
    """A layer's attention module changed what its cache returned before attention (MLA expands
    its latent), or computed attention without the attention interface (differential attention):
    ``Block.forward_batch`` rewinds the step and runs that layer's attention module row by row
    instead (``rowwise_attention``)."""

    def __init__(self, idx: int) -> None:
        super().__init__(f"layer {idx} transforms its cached states before attention")
        self.idx = idx


class rowwise_attention:
    """``with rowwise_attention(module, rows, idx):`` the attention module of layer ``idx`` runs
    once per row, on the row's own cache, positions and mask, as a step run alone would run it;
    the rest of the layer (norms, MLP, experts) stays batched."""

    def __init__(self, module, rows: Rows, idx: int) -> None:
        self.module, self.rows, self.idx = module, rows, idx

    def __enter__(self) -> None:
        module, rows, kind = self.module, self.rows, self.rows.layer_types[self.idx]
        forward = type(module).forward

        def per_row(hidden_states, *args, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
            out, extra = None, 1
            b = hidden_states.shape[0]
            for row, new in enumerate(rows.news):
                pe = _row_of(position_embeddings, row, new, b)
                o = forward(module, hidden_states[row:row + 1, :new], *args, position_embeddings=pe,
                            attention_mask=rows.mask(row, kind, hidden_states.device),
                            cache=rows.caches[row], **{k: _row_of(v, row, new, b) for k, v in kwargs.items()})
                if isinstance(o, tuple):
                    o, extra = o[0], len(o) - 1
                if out is None:
                    out = o.new_zeros(b, hidden_states.shape[1], *o.shape[2:])
                out[row, :new] = o[0]
            return (out, *([None] * extra))  # (attention weights, router logits: not kept in inference)

        module.forward = per_row

    def __exit__(self, *exc) -> None:
        del self.module.forward


def _row_of(value, row: int, new: int, rows: int):
    """``value``'s part for one row, where it has a row per batch entry and a position axis."""
    if isinstance(value, tuple):
        return tuple(_row_of(v, row, new, rows) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows:
        return value[row:row + 1, :new]
    return value


def _inner_attention(module, name: str):
    if name == "eager":  # the family's own eager function (softcaps, sinks, ...)
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


AttentionInterface.register(ROWS_ATTENTION, rows_attention)


class rows_context:
    """``with rows_context(configs, rows):`` a batched step's layers run under ``rows_attention``
    (``configs``: those the block's attention modules read their implementation from)."""

    def __init__(self, configs: list, rows: Rows) -> None:
        self.configs, self.rows = configs, rows

    def __enter__(self) -> None:
        self._token = _ROWS.set(self.rows)
        self._saved = [c._attn_implementation_internal for c in self.configs]
        for c in self.configs:
            c._attn_implementation_internal = ROWS_ATTENTION

    def __exit__(self, *exc) -> None:
        for c, saved in zip(self.configs, self._saved):
            c._attn_implementation_internal = saved
        _ROWS.reset(self._token)
