"""GGUF blocks (shardnet/inference/model/gguf.py): the torch dequantizers give bit for bit what
gguf-py's reference ``gguf.quants.dequantize`` gives, and the test writer's Q4_K encoder
(shardnet/testing/gguf.py; gguf-py has none) writes blocks gguf-py reads back to the weights."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from shardnet.inference.model.gguf import GgufBlocks, dequantize
from shardnet.inference.model.stored import StoredWeight
from shardnet.testing.gguf import permute, quantize_q4_k


def weights(rows=48, cols=512, seed=0):
    x = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.3).astype(np.float32)
    x[1] = 0                   # an all-zero row: scales 0, no 0/0
    x[2] = np.abs(x[2])        # all positive: sub-block min 0
    x[3] = -np.abs(x[3]) * 40  # all negative and large
    return x


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K])
def test_torch_dequantizer_is_gguf_py_bit_for_bit(qtype):
    x = weights()
    blocks = gguf_quantize(x, T.Q8_0) if qtype == T.Q8_0 else quantize_q4_k(x)
    ours = dequantize(torch.from_numpy(blocks), int(qtype)).numpy()
    assert np.array_equal(bits(ours), bits(gguf_dequantize(blocks, qtype)))


def test_random_blocks_too():
    """Every bit pattern of the scales and values, not just what an encoder writes (fp16 d and
    dmin kept finite)."""
    raw = np.random.default_rng(1).integers(0, 256, size=(64, 144 * 2), dtype=np.uint8)
    for off in (0, 144):
        raw[:, off:off + 4].view(np.float16)[:] = np.random.default_rng(2).standard_normal((64, 2)).astype(np.float16)
    ours = dequantize(torch.from_numpy(raw), int(T.Q4_K)).numpy()
    assert np.array_equal(bits(ours), bits(gguf_dequantize(raw, T.Q4_K)))


def test_q4_k_encoder_round_trips_through_gguf_py():
    x = weights()
    back = gguf_dequantize(quantize_q4_k(x), T.Q4_K)
    # 16 levels over each 32-value sub-block's range (plus 6-bit scales): within a level
    span = (x.reshape(-1, 32).max(1) - np.minimum(x.reshape(-1, 32).min(1), 0)).reshape(x.shape[0], -1)
    err = np.abs(back - x).reshape(x.shape[0], -1, 32).max(-1)
    assert (err <= span / 15 + 1e-6).all()
    assert np.array_equal(back[1], x[1])


def test_a_stored_gguf_weight_computes_with_its_dequantized_rows():
    x = weights(rows=8, cols=256)
    w = StoredWeight(GgufBlocks(int(T.Q4_K)), {"blocks": torch.from_numpy(quantize_q4_k(x))}, (8, 256), torch.float32)
    dense = torch.from_numpy(gguf_dequantize(quantize_q4_k(x), T.Q4_K))
    inp = torch.randn(3, 256)
    assert torch.equal(torch.nn.functional.linear(inp, w), torch.nn.functional.linear(inp, dense))
    assert w.stored_nbytes() == 8 * 144
    both = torch.cat([w, w], dim=-1)  # rows are whole blocks: joined as bytes
    assert torch.equal(both.dequantize(), torch.cat([dense, dense], -1))


def test_q_k_row_order_is_undone_as_transformers_undoes_it():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from shardnet.inference.model.gguf import row_order

    w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2}
    for name, kv in (("blk.0.attn_q.weight", 4), ("blk.0.attn_k.weight", 2)):
        stored = permute(w, 4, kv)
        theirs = LlamaTensorProcessor(cfg).process(stored, name).weights
        assert np.array_equal(theirs, w)
        assert np.array_equal(stored[row_order(name, 16, cfg).numpy()], w)
    assert row_order("blk.0.attn_v.weight", 16, cfg) is None


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K])
def test_dequantized_into_a_buffer_a_few_rows_at_a_time_the_same_bits(qtype, monkeypatch):
    from shardnet.inference.model import stored as stored_module

    x = weights(rows=11, cols=512)
    blocks = quantize_q4_k(x) if qtype == T.Q4_K else gguf_quantize(x, qtype)
    w = StoredWeight(GgufBlocks(int(qtype)), {"blocks": torch.from_numpy(blocks)}, (11, 512), torch.bfloat16)
    rows = stored_module.dequantize_rows
    monkeypatch.setattr("shardnet.inference.model.gguf.dequantize_rows",
                        lambda dequantize, parts, out, per, step, dims=None: rows(dequantize, parts, out, per, 4))
    out = torch.empty(11, 512, dtype=torch.bfloat16)
    w.fmt.dequantize_into(w.parts, out)  # (pieces of 4 rows, the last one short)
    assert torch.equal(out, w.dequantize())
