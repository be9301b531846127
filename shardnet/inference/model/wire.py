"""Tensors to and from activation-protocol payloads: dtype name, shape, raw bytes. No pickle.

Hidden states may travel compressed: float16 / bfloat16 (half the bytes of float32), or int8q
(int8 values with one float32 scale per position, about a quarter), chosen per session.
"""

from __future__ import annotations

import math

import torch

from shardnet.protocols.activation import QUANTIZED, TensorMessage

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def to_payload(t: torch.Tensor, wire: str | None = None) -> tuple[str, list[int], bytes]:
    """Encode ``t`` in ``wire`` (a dtype name or int8q; default: its own dtype)."""
    t = t.detach().to("cpu")
    if wire == QUANTIZED:
        x = t.float().contiguous()
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
        q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
        return QUANTIZED, list(t.shape), _bytes(q) + _bytes(scale.squeeze(-1).contiguous())
    if wire is not None:
        t = t.to(TORCH_DTYPES[wire])
    t = t.contiguous()
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"cannot send tensors of dtype {t.dtype}")
    return DTYPE_NAMES[t.dtype], list(t.shape), _bytes(t)


def from_message(msg: TensorMessage) -> torch.Tensor:
    """The tensor a validated step/result message carries (its byte count was checked);
    int8q comes back dequantized, in float32."""
    return decode(msg.dtype, msg.shape, msg.payload)


def decode(dtype_name: str, shape, payload: bytes) -> torch.Tensor:
    """The tensor ``to_payload`` encoded (the byte count must match the shape)."""
    shape = list(shape)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    if dtype_name == QUANTIZED:
        n = math.prod(shape)
        q = raw[:n].view(torch.int8).reshape(shape).float()
        scale = raw[n:].view(torch.float32).reshape(*shape[:-1], 1)
        return q * scale
    dtype = TORCH_DTYPES[dtype_name]
    if not payload:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return t.view(torch.uint8).numpy().tobytes()
