"""Weights kept in the low-bit format their checkpoint stores them in, computed from directly.

A ``StoredWeight`` is a torch tensor subclass that stands where a module's weight stands (an
``nn.Linear``'s ``weight``, a transformers expert bank ``experts.gate_up_proj`` [E, O, I]) with
the weight's logical shape and compute dtype, while it holds only its stored parts: e.g. an FP8
weight and its block scales, or packed int4 and its group scales (``StoredFormat`` says how to
read them). transformers' modules run on it unchanged:

- ``F.linear(x, w)``, ``x @ w``, ``torch.matmul``: the weight is dequantized into the compute
  dtype just for that call, on CPU into one buffer reused by every call (``_Scratch``: grown to
  the largest weight, so a peer holds its weights at their stored size plus one weight in the
  compute dtype; a format without ``dequantize_into``, a GPU, or a second thread computing at the
  same time gets a new tensor freed after the call); ``torch._grouped_mm`` over a bank
  (transformers' grouped_mm experts) runs one expert at a time, the experts with rows only;
- ``bank[e]`` (transformers' expert loop), ``w.t()``, ``w.transpose(-1, -2)``, ``detach``,
  ``torch.stack`` of per-expert weights (transformers' key conversion stacks them into banks) and
  ``.to(dtype)`` are views of the stored parts: they dequantize nothing;
- any other operation on it dequantizes it first and runs on the result (correct, just not kept).

GPU kernels (opt-in, not yet run on any device): a format may define ``cuda_linear(x, parts)``,
``x @ W.T`` for a 2-D stored ``W`` [out, in] straight from its parts with a kernel of the device
(FP8: ``torch._scaled_mm``'s recipes, fp8.py; int4: PyTorch's tinygemm, int4.py), or None where
it has none for that case. ``F.linear(x, w)`` and ``x @ w.t()`` (``mm``/``addmm``/``matmul``)
use it only when ``SHARDNET_STORED_KERNELS=1`` is set and the weight is on a CUDA device
(``kernels_enabled``); everywhere else, and wherever the hook returns None, the weight is
dequantized as above. ``KERNEL_CALLS`` counts the calls each format's kernel served.

``stored_nbytes(t)``: what a tensor holds in memory, stored parts for a ``StoredWeight``; every
byte count of a block (its load report, placement, claims) goes through it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten


class StoredFormat(Protocol):
    """How one stored format reads its parts. Parts are tensors whose leading dims are the
    weight's bank dims (none for a Linear's weight), so a bank's expert is every part's [e]."""

    name: str

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The logical weight [..., out, in] in ``dtype``."""
        ...

    # optional: ``cat(parts_list, dim, shapes)``, the parts of the weights joined along dim -2
    # (out) or -1 (in) of their logical ``shapes``, or None where the format cannot join them;
    # ``dequantize_into(parts, out)``: what ``dequantize`` returns, written into ``out`` (a few
    # rows at a time, so that its float32 intermediates stay small), bit for bit the same


@dataclass(frozen=True)
class _Layout:
    fmt: StoredFormat
    transposed: bool  # the logical tensor is the stored weight with its last two dims swapped


class StoredWeight(torch.Tensor):
    """A weight of logical ``shape`` and ``dtype`` held as ``parts`` of format ``fmt``."""

    parts: dict[str, torch.Tensor]
    stored_layout: _Layout

    @staticmethod
    def __new__(cls, fmt: StoredFormat, parts: dict[str, torch.Tensor], shape, dtype: torch.dtype,
                transposed: bool = False):
        device = next(iter(parts.values())).device
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device, requires_grad=False)
        t.parts = parts
        t.stored_layout = _Layout(fmt, transposed)
        return t

    def __init__(self, *args, **kwargs) -> None:
        pass

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # views are made here, above autograd: made in the dispatcher, a view of a subclass
        # cannot be an inference tensor's (transformers runs layers in inference mode)
        kwargs = kwargs or {}
        view = _FUNCTION_VIEWS.get(func)
        if view is not None and isinstance(args[0], StoredWeight):
            out = view(*args, **kwargs)
            if out is not None:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @property
    def fmt(self) -> StoredFormat:
        return self.stored_layout.fmt

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        w = self.fmt.dequantize(self.parts, dtype or self.dtype)
        return w.transpose(-1, -2) if self.stored_layout.transposed else w

    def stored_nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    def _with(self, parts=None, shape=None, dtype=None, transposed=None) -> StoredWeight:
        return StoredWeight(self.fmt, self.parts if parts is None else parts,
                            self.shape if shape is None else shape, self.dtype if dtype is None else dtype,
                            self.stored_layout.transposed if transposed is None else transposed)

    def __repr__(self) -> str:
        return (f"StoredWeight({self.fmt.name}, shape={list(self.shape)}, dtype={self.dtype}, "
                f"stored={self.stored_nbytes()} bytes{', transposed' if self.stored_layout.transposed else ''})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        view = _VIEWS.get(func)
        if view is not None:
            out = view(*args, **kwargs)
            if out is not None:
                return out
        if func in _KERNEL_OPS:
            out = _kernel_linear(func, args, kwargs)
            if out is not None:
                return out
        if func in _COMPUTE_OPS:
            stored = [a for a in (*args, *kwargs.values()) if isinstance(a, StoredWeight)]
            if len(stored) == 1:
                with SCRATCH.dense(stored[0]) as w:
                    def swap(a):
                        return w if a is stored[0] else a
                    return func(*map(swap, args), **{k: swap(v) for k, v in kwargs.items()})
        return func(*tree_map(_dense, args), **tree_map(_dense, kwargs))


def _dense(x):
    return x.dequantize() if isinstance(x, StoredWeight) else x


#: ops whose result is new memory, never a view of an argument: a stored weight among their
#: arguments is dequantized into the scratch buffer, which the next call overwrites
_COMPUTE_OPS = {aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
                aten.baddbmm.default, aten._grouped_mm.default}


#: set to 1 to let stored weights on a CUDA device use their format's kernel (``cuda_linear``):
#: opt-in while no device has run them (bench/gpu_check.py's stored-kernel rows check them)
KERNELS_ENV = "SHARDNET_STORED_KERNELS"
#: format name -> calls its ``cuda_linear`` served (bench/gpu_check.py checks the kernels ran)
KERNEL_CALLS: Counter[str] = Counter()


def on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def kernels_enabled(device: torch.device) -> bool:
    """Whether a stored weight on ``device`` may use its format's kernel: ``SHARDNET_STORED_KERNELS=1``
    and a CUDA device."""
    return os.environ.get(KERNELS_ENV) == "1" and on_cuda(device)


#: the ops ``_kernel_linear`` serves: linear(x, W[, b]), and mm/matmul(x, W.t()), addmm(b, x, W.t())
_KERNEL_OPS = {aten.linear.default, aten.mm.default, aten.matmul.default, aten.addmm.default}


def _kernel_linear(func, args, kwargs) -> torch.Tensor | None:
    """``func`` computed by the stored weight's ``cuda_linear``, or None (the dequantizing path)
    where the op is not ``x @ W.T (+ b)`` of a 2-D stored ``W``, kernels are not enabled for its
    device, or its format has no kernel for this case."""
    if func is aten.linear.default:
        x, w, bias = (*args, None)[:3] if not kwargs else (args[0], args[1], kwargs.get("bias"))
        transposed = False
    elif func is aten.addmm.default and len(args) == 3 and not kwargs:  # (beta = alpha = 1)
        bias, x, w = args
        transposed = True
    elif func in (aten.mm.default, aten.matmul.default) and len(args) == 2 and not kwargs:
        (x, w), bias, transposed = args, None, True
    else:
        return None
    if not isinstance(w, StoredWeight) or isinstance(x, StoredWeight) or isinstance(bias, StoredWeight) \
            or w.dim() != 2 or w.stored_layout.transposed != transposed:
        return None
    hook = getattr(w.fmt, "cuda_linear", None)
    if hook is None or not kernels_enabled(w.device):
        return None
    out = hook(x, w.parts)
    if out is None:
        return None
    KERNEL_CALLS[w.fmt.name] += 1
    return out if bias is None else out + bias


class _Scratch:
    """The buffer weights are dequantized into for one op each: one per compute dtype and device,
    grown to the largest weight it has held. One thread uses it at a time; another finds it
    taken and gets a tensor of its own (a peer computes one block's pass at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[tuple, torch.Tensor] = {}

    @contextlib.contextmanager
    def dense(self, w: StoredWeight):
        """``w`` dequantized, valid inside the ``with`` only."""
        into = getattr(w.fmt, "dequantize_into", None)
        # (with grad on, an op may keep its inputs for backward; on a GPU the caching allocator
        # reuses freed blocks itself, and a kernel may still read the buffer when the next call
        # would write it)
        if into is None or torch.is_grad_enabled() or w.device.type != "cpu" \
                or not self._lock.acquire(blocking=False):
            yield w.dequantize()
            return
        try:
            shape = list(w.shape)
            if w.stored_layout.transposed:
                shape[-1], shape[-2] = shape[-2], shape[-1]
            n = w.numel()
            key = (w.dtype, w.device)
            # (made and written in inference mode: an inference tensor may only be written there)
            with torch.inference_mode():
                buffer = self._buffers.get(key)
                if buffer is None or buffer.numel() < n:
                    self._buffers.pop(key, None)  # (the smaller one goes before the larger comes)
                    buffer = self._buffers[key] = torch.empty(n, dtype=w.dtype, device=w.device)
                out = buffer[:n].view(shape)
                into(w.parts, out)
            yield out.transpose(-1, -2) if w.stored_layout.transposed else out
        finally:
            self._lock.release()

    def nbytes(self) -> int:
        """Bytes the buffers hold now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


SCRATCH = _Scratch()


def dequantize_rows(dequantize, parts: dict[str, torch.Tensor], out: torch.Tensor, rows: dict[str, int],
                    step: int, dims: dict[str, int] | None = None) -> None:
    """``out`` [..., O, I] = ``dequantize(parts, out.dtype)``, ``step`` rows (of O) at a time. Each
    part holds O along its dim ``dims[name]`` (default -2), ``rows[name]`` of O's rows per index
    there (a block scale: one per block of rows; 8 nibbles packed in an int32: 8). ``step`` is a
    multiple of every ``rows``."""
    total = out.shape[-2]
    for r in range(0, total, step):
        end = min(r + step, total)
        piece = {}
        for k, p in parts.items():
            dim, per = (dims or {}).get(k, -2), rows[k]
            piece[k] = p.narrow(dim, r // per, -(-end // per) - r // per)
        out[..., r:end, :].copy_(dequantize(piece, out.dtype))


def _swap_last(w: StoredWeight, *dims) -> StoredWeight | None:
    nd = w.dim()
    if len(dims) == 2 and {d % nd for d in dims} != {nd - 2, nd - 1}:
        return None
    shape = list(w.shape)
    shape[-1], shape[-2] = shape[-2], shape[-1]
    return w._with(shape=shape, transposed=not w.stored_layout.transposed)


def _select(w: StoredWeight, dim: int, index: int) -> StoredWeight | None:
    if dim % w.dim() != 0 or w.dim() < 3:  # only a bank's leading dim is a view of the parts
        return None
    return w._with(parts={k: p[index] for k, p in w.parts.items()}, shape=w.shape[1:])


def _stack(tensors, dim: int = 0) -> StoredWeight | None:
    ws = list(tensors)
    first = ws[0]
    if dim != 0 or not all(isinstance(w, StoredWeight) and w.stored_layout == first.stored_layout and w.dtype == first.dtype
                           and w.shape == first.shape and w.parts.keys() == first.parts.keys() for w in ws):
        return None
    parts = {k: torch.stack([w.parts[k] for w in ws]) for k in first.parts}
    return first._with(parts=parts, shape=(len(ws), *first.shape))


def _cat(tensors, dim: int = 0) -> StoredWeight | None:
    """Stored weights joined along their out or in dim (transformers' key conversion fuses gate and
    up projections): the parts joined, where the format can (``StoredFormat.cat``)."""
    ws = list(tensors)
    first = ws[0]
    if not all(isinstance(w, StoredWeight) and w.stored_layout == first.stored_layout and w.dtype == first.dtype
               and w.dim() == first.dim() for w in ws) or first.stored_layout.transposed:
        return None
    nd = first.dim()
    dim %= nd
    if dim < nd - 2:  # a bank dim: every part has it
        parts = {k: torch.cat([w.parts[k] for w in ws], dim) for k in first.parts}
    else:
        cat = getattr(first.fmt, "cat", None)
        parts = cat([w.parts for w in ws], dim - nd, [tuple(w.shape) for w in ws]) if cat else None
        if parts is None:
            return None
    shape = list(first.shape)
    shape[dim] = sum(w.shape[dim] for w in ws)
    return first._with(parts=parts, shape=shape)


def _grouped_mm(x: torch.Tensor, w, offs=None, bias=None, out_dtype=None) -> torch.Tensor | None:
    """``x`` [S, in] (rows sorted by expert, ``offs`` their cumulative counts) through a bank
    [E, in, out] (transformers' grouped_mm experts implementation): the same op, one expert at a
    time, each dequantized for its rows only; experts without rows are skipped."""
    if not isinstance(w, StoredWeight) or isinstance(x, StoredWeight) or w.dim() != 3 or x.dim() != 2 \
            or offs is None or bias is not None or out_dtype not in (None, x.dtype):
        return None
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            one = offs.new_tensor([end - start])
            with SCRATCH.dense(_select(w, 0, e)) as expert:
                out[start:end] = aten._grouped_mm(x[start:end], expert[None], one)
        start = end
    return out


def _to_copy(w: StoredWeight, *, dtype=None, device=None, layout=None, memory_format=None, non_blocking=False,
             pin_memory=None, **_) -> StoredWeight | None:
    if not isinstance(w, StoredWeight) or (layout not in (None, torch.strided)):
        return None
    parts = w.parts if device is None else {k: p.to(device) for k, p in w.parts.items()}
    return w._with(parts=parts, dtype=dtype)


def _getitem(w: StoredWeight, index) -> StoredWeight | None:
    if isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point():
        index = int(index)
    return _select(w, 0, index) if isinstance(index, int) else None


_VIEWS = {
    aten.detach.default: lambda w: w._with(),
    aten.alias.default: lambda w: w._with(),
    aten.t.default: lambda w: _swap_last(w),
    aten.transpose.int: lambda w, a, b: _swap_last(w, a, b),
    aten.select.int: _select,
    aten.stack.default: _stack,
    aten.cat.default: _cat,
    aten._to_copy.default: _to_copy,
    aten._grouped_mm.default: _grouped_mm,
}

_FUNCTION_VIEWS = {
    torch.Tensor.__getitem__: _getitem,
    torch.Tensor.select: lambda w, dim, index: _select(w, dim, index),
    torch.select: lambda w, dim, index: _select(w, dim, index),
    torch.Tensor.t: lambda w: _swap_last(w),
    torch.t: lambda w: _swap_last(w),
    torch.Tensor.transpose: lambda w, a, b: _swap_last(w, a, b),
    torch.transpose: lambda w, a, b: _swap_last(w, a, b),
    torch.Tensor.mT.__get__: lambda w: _swap_last(w),
}


def stored_nbytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds in memory: its stored parts for a ``StoredWeight``."""
    return t.stored_nbytes() if isinstance(t, StoredWeight) else t.numel() * t.element_size()


def module_stored_nbytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers as held (stored parts for stored weights)."""
    return sum(stored_nbytes(t) for t in (*module.parameters(), *module.buffers()))
