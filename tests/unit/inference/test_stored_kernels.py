"""The opt-in GPU kernel path of stored weights (stored.py ``_kernel_linear``), on the CPU: a
format's ``cuda_linear`` serves ``x @ W.T`` only when SHARDNET_STORED_KERNELS=1 is set and the
weight is on a CUDA device (a fake device predicate stands in for one here); otherwise, and
wherever the hook returns None, the weight is dequantized as before. The kernels themselves run
in bench/gpu_check.py's stored-kernel rows (a GPU is needed)."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from shardnet.inference.model import stored
from shardnet.inference.model.fp8 import Fp8Blocks, dequantize, quantize_groups, stored_fp8_blocks
from shardnet.inference.model.int4 import stored_int4
from shardnet.inference.model.stored import KERNELS_ENV, StoredWeight
from shardnet.testing.fp8 import quantize_fp8_blocks
from shardnet.testing.int4 import gptq_tensors

SENTINEL = 1234.0


@dataclass(frozen=True)
class Plain:
    """A 'format' whose parts are the dense weight, with a kernel hook that records its calls."""

    name = "plain"
    calls: list

    def dequantize(self, parts, dtype):
        return parts["w"].to(dtype)

    def cuda_linear(self, x, parts):
        self.calls.append(tuple(x.shape))
        return torch.full((*x.shape[:-1], parts["w"].shape[0]), SENTINEL, dtype=x.dtype)


def plain_weight():
    calls = []
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    return StoredWeight(Plain(calls), {"w": w}, w.shape, torch.float32), w, calls


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(stored, "on_cuda", lambda device: True)


def test_the_hook_serves_linear_mm_addmm_and_matmul_only_with_the_variable_and_a_cuda_device(monkeypatch, fake_cuda):
    w, dense, calls = plain_weight()
    x, bias = torch.randn(2, 3, 16), torch.randn(8)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert torch.equal(F.linear(x, w, bias), F.linear(x, dense, bias)) and calls == []
    monkeypatch.setenv(KERNELS_ENV, "0")
    assert torch.equal(x @ w.t(), x @ dense.t()) and calls == []
    monkeypatch.setenv(KERNELS_ENV, "1")
    before = stored.KERNEL_CALLS["plain"]
    with torch.inference_mode():
        assert torch.equal(F.linear(x, w), torch.full((2, 3, 8), SENTINEL))
        assert torch.equal(F.linear(x, w, bias), SENTINEL + bias.expand(2, 3, 8))
        assert torch.equal(x @ w.t(), torch.full((2, 3, 8), SENTINEL))
        assert torch.equal(torch.mm(x[0], w.t()), torch.full((3, 8), SENTINEL))
        assert torch.equal(torch.addmm(bias, x[0], w.t()), SENTINEL + bias.expand(3, 8))
    assert len(calls) == 5 and stored.KERNEL_CALLS["plain"] == before + 5


def test_no_hook_on_the_cpu_even_with_the_variable(monkeypatch):
    w, dense, calls = plain_weight()
    monkeypatch.setenv(KERNELS_ENV, "1")
    x = torch.randn(3, 16)
    assert torch.equal(F.linear(x, w), F.linear(x, dense)) and torch.equal(x @ w.t(), x @ dense.t())
    assert calls == []


def test_what_the_hook_does_not_serve_is_dequantized(monkeypatch, fake_cuda):
    monkeypatch.setenv(KERNELS_ENV, "1")
    w, dense, calls = plain_weight()
    x = torch.randn(3, 8)
    assert torch.equal(x @ w, x @ dense)  # W not transposed: not x @ W.T
    assert torch.equal(torch.addmm(torch.ones(16), x, w, beta=2), torch.addmm(torch.ones(16), x, dense, beta=2))
    bank = torch.stack([w, w])  # a bank (3-D) is dequantized; one expert of it (2-D) goes to the hook
    ones = torch.ones(2, 3, 16)
    assert torch.equal(torch.bmm(ones, bank.mT), torch.bmm(ones, torch.stack([dense, dense]).mT))
    assert calls == []
    assert torch.equal(ones[0] @ bank[1].t(), torch.full((3, 8), SENTINEL)) and calls == [(3, 16)]


def test_a_hook_returning_none_falls_back(monkeypatch, fake_cuda):
    monkeypatch.setenv(KERNELS_ENV, "1")
    w, dense, calls = plain_weight()
    monkeypatch.setattr(Plain, "cuda_linear", lambda self, x, parts: None)
    x = torch.randn(3, 16)
    assert torch.equal(F.linear(x, w), F.linear(x, dense))


def test_the_formats_hooks_return_none_on_the_cpu(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "1")
    g = torch.Generator().manual_seed(1)
    q, s = quantize_fp8_blocks(torch.randn(128, 128, generator=g), (128, 128))
    fp8 = stored_fp8_blocks({"w": q, "w_scale_inv": s}, (128, 128), torch.bfloat16)["w"]
    t = {f"l.{k}": v for k, v in gptq_tensors(torch.randn(64, 128, generator=g), 32, sym=True).items()}
    int4 = stored_int4("gptq", "l", t, {"method": "gptq", "group_size": 32, "zeros_minus_one": True}, torch.bfloat16)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    for w in (fp8, int4):
        assert w.fmt.cuda_linear(x, w.parts) is None
    assert torch.equal(F.linear(x, fp8), F.linear(x, dequantize(q, s, (128, 128)).to(torch.bfloat16)))


def test_activation_groups_round_to_e4m3():
    """The activations' half of the FP8 kernel: each value within 2^-4 of itself (3 mantissa
    bits) or of its group's smallest normal step, the last group partial."""
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_groups(x, 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 200) and scale.shape == (3, 2)
    back = q.float() * scale.repeat_interleave(128, -1)[:, :200]
    tiny = scale.repeat_interleave(128, -1)[:, :200] * 2.0 ** -6  # e4m3's smallest normal
    assert bool(((back - x).abs() <= x.abs() * 2.0 ** -4 + tiny).all())
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1))
    assert Fp8Blocks((128, 128)).name == "fp8-blocks"
