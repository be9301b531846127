"""Tensors to and from activation-protocol payloads: dtype name, shape, raw bytes. No pickle."""

from __future__ import annotations

import torch

from shardnet.protocols.activation import Message

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def to_payload(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    t = t.detach().to("cpu").contiguous()
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"cannot send tensors of dtype {t.dtype}")
    return DTYPE_NAMES[t.dtype], list(t.shape), t.view(torch.uint8).numpy().tobytes()


def from_message(msg: Message) -> torch.Tensor:
    """The tensor a validated step/result message carries (its byte count was checked)."""
    dtype = TORCH_DTYPES[msg["dtype"]]
    shape = msg["shape"]
    if not msg.payload:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(msg.payload), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
