"""Stored (low-bit) checkpoint formats: which a checkpoint uses, and how each is kept as stored.

A checkpoint's ``quantization_config.quant_method`` names its format; each supported format is a
module with three functions:

- ``parse(qconfig: dict) -> dict``: the format's parameters (block size, group size, bits...),
  or ``CheckpointError`` with a one-line reason for a variant it does not read;
- ``to_stored(tensors, params, dtype) -> dict``: a layer's loaded tensors with every quantized
  weight and its companions (scales, zero points, packed values) replaced by one ``StoredWeight``
  (stored.py) under the name the unquantized model gives that weight, in compute ``dtype``;
- ``held_bytes(name, info, dtype_bytes, params) -> int``: the bytes a checkpoint tensor takes
  once loaded (its stored size for quantized parts, ``dtype_bytes`` a value for the rest);
- ``COMPANION_SUFFIXES``: the name endings of tensors that only accompany a quantized weight.

Placement, claims, the load report and the simulation count bytes through ``held_bytes`` and
``stored.stored_nbytes``: one rule for what a stored format costs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardnet.errors import CheckpointError

if TYPE_CHECKING:
    import torch

#: quant_method -> the module that reads it
FORMATS: dict[str, str] = {
    "fp8": "shardnet.inference.model.fp8",
    "gguf": "shardnet.inference.model.gguf",
    **dict.fromkeys(("gptq", "awq", "compressed-tensors"), "shardnet.inference.model.int4"),
    "mxfp4": "shardnet.inference.model.mxfp4",
}


@dataclass(frozen=True)
class StoredQuant:
    """A checkpoint's stored format: its ``method`` and parsed ``params``."""

    method: str
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def module(self):
        return importlib.import_module(FORMATS[self.method])


def stored_quant(raw_config: dict) -> StoredQuant | None:
    """The stored format a config.json declares; None when the checkpoint is not quantized; a
    one-line refusal naming the supported formats for any other."""
    q = raw_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in FORMATS:
        raise CheckpointError(f"stored quantization {method!r} is not supported (supported: "
                              f"{', '.join(sorted(FORMATS))})")
    return StoredQuant(method, importlib.import_module(FORMATS[method]).parse(q))


def to_stored(quant: StoredQuant | None, tensors: dict[str, "torch.Tensor"], dtype: "torch.dtype") -> dict:
    """``tensors`` as a layer keeps them (see the module docstring); unchanged when not quantized."""
    return tensors if quant is None else quant.module.to_stored(tensors, quant.params, dtype)


def held_bytes(quant: StoredQuant | None, name: str, info, dtype_bytes: int) -> int:
    """Bytes checkpoint tensor ``name`` (``info``: its dtype, shape, size) takes once loaded."""
    if quant is None:
        n = 1
        for d in info.shape:
            n *= d
        return n * dtype_bytes
    return quant.module.held_bytes(name, info, dtype_bytes, quant.params)
