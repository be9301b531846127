"""StoredWeight (shardnet/inference/model/stored.py): a weight kept in its stored format stands
where a dense one does, computes what its dequantized copy computes, and holds its stored bytes."""

import pytest
import torch
import torch.nn.functional as F

from shardnet.inference.model.fp8 import Fp8Blocks, dequantize, stored_fp8_blocks
from shardnet.inference.model.stored import StoredWeight, module_stored_nbytes, stored_nbytes
from shardnet.testing.fp8 import quantize_fp8_blocks

BLOCK = (16, 16)


def fp8_weight(out=40, inp=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_fp8_blocks(torch.randn(out, inp, generator=g), BLOCK)
    return stored_fp8_blocks({"w": q, "w_scale_inv": s}, BLOCK, torch.float32)["w"], dequantize(q, s, BLOCK)


def test_linear_and_matmul_compute_what_the_dequantized_weight_computes():
    w, dense = fp8_weight()
    x = torch.randn(2, 5, 48)
    assert torch.equal(F.linear(x, w), F.linear(x, dense))
    assert torch.equal(x @ w.t(), x @ dense.t()) and torch.equal(x @ w.mT, x @ dense.mT)
    lin = torch.nn.Linear(48, 40, bias=False)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    with torch.inference_mode():  # (transformers runs layers so)
        assert torch.equal(lin(x), F.linear(x, dense))
    assert type(lin.weight) is StoredWeight and lin.weight.shape == (40, 48)


def test_bytes_are_the_stored_parts():
    w, dense = fp8_weight()
    assert stored_nbytes(w) == 40 * 48 * 1 + 3 * 3 * 4  # FP8 bytes and float32 block scales
    assert stored_nbytes(dense) == 40 * 48 * 4
    lin = torch.nn.Linear(48, 40, bias=True)
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    assert module_stored_nbytes(lin) == stored_nbytes(w) + 40 * 4


def test_a_bank_of_experts_is_stacked_indexed_and_fused_without_dequantizing():
    pairs = [fp8_weight(seed=i) for i in range(3)]
    bank = torch.stack([w for w, _ in pairs])  # transformers' conversion stacks per-expert weights
    assert type(bank) is StoredWeight and bank.shape == (3, 40, 48)
    assert stored_nbytes(bank) == sum(stored_nbytes(w) for w, _ in pairs)
    x = torch.randn(4, 48)
    with torch.inference_mode():
        for e, (_, dense) in enumerate(pairs):
            assert type(bank[e]) is StoredWeight and type(bank[torch.tensor(e)]) is StoredWeight
            assert torch.equal(F.linear(x, bank[e]), F.linear(x, dense))
            assert torch.equal(x @ bank.transpose(-1, -2)[e], x @ dense.t())
    # gate and up fused along the out dim (48 rows: whole 16-row blocks): still stored
    up = torch.stack([fp8_weight(48, 48, seed=10 + i)[0] for i in range(3)])
    gate = torch.stack([fp8_weight(48, 48, seed=20 + i)[0] for i in range(3)])
    fused = torch.cat([gate, up], dim=1)
    assert type(fused) is StoredWeight and fused.shape == (3, 96, 48)
    assert torch.equal(fused.dequantize(), torch.cat([gate.dequantize(), up.dequantize()], dim=1))


def test_to_dtype_is_a_view_and_other_ops_run_on_the_dequantized_weight():
    w, dense = fp8_weight()
    half = w.to(torch.bfloat16)
    assert type(half) is StoredWeight and half.dtype == torch.bfloat16 and stored_nbytes(half) == stored_nbytes(w)
    assert torch.equal(half.dequantize(), dense.to(torch.bfloat16))
    assert torch.equal(w.sum(0), dense.sum(0)) and type(w * 2) is torch.Tensor
    # blocks that do not divide: joining along out dim dequantizes (correct, not kept)
    a, da = fp8_weight(40, 48, seed=1)
    assert torch.equal(torch.cat([a, w]), torch.cat([da, dense]))
    assert "fp8-blocks" in repr(w) and Fp8Blocks(BLOCK).name == "fp8-blocks"


def test_an_fp8_weight_without_its_scales_is_refused():
    from shardnet.errors import CheckpointError

    q, _ = quantize_fp8_blocks(torch.randn(32, 32), BLOCK)
    with pytest.raises(CheckpointError, match="has no w_scale_inv"):
        stored_fp8_blocks({"w": q}, BLOCK, torch.float32)


def test_weights_are_dequantized_into_one_reused_buffer_with_the_same_results():
    """Under inference mode a stored weight's op dequantizes into ``SCRATCH``: one buffer, grown
    to the largest weight, the same bits as a fresh dequantization (FP8 a few rows at a time,
    transposed or not, through a row count that is not a multiple of the block, a bank's
    expert); with grad on, or while the buffer is taken, a fresh tensor as before."""
    import threading

    from shardnet.inference.model import fp8 as fp8_module
    from shardnet.inference.model.stored import SCRATCH

    big, big_dense = fp8_weight(72, 48, seed=5)
    small, small_dense = fp8_weight(40, 48, seed=6)
    bank = torch.stack([fp8_weight(seed=7)[0], fp8_weight(seed=8)[0]])
    x = torch.randn(3, 48)
    chunk = fp8_module.CHUNK
    fp8_module.CHUNK = 16 * 48  # (one block row a piece: several pieces, the last one short)
    try:
        with torch.inference_mode():
            assert torch.equal(F.linear(x, big), F.linear(x, big_dense))
            buffer = SCRATCH._buffers[(big.dtype, big.device)]
            assert buffer.numel() >= big.numel()
            assert torch.equal(x @ small.t(), x @ small_dense.t())
            assert torch.equal(torch.matmul(x[:, :40], small), torch.matmul(x[:, :40], small_dense))
            assert torch.equal(F.linear(x, bank[1]), F.linear(x, bank.dequantize()[1]))
            assert SCRATCH._buffers[(big.dtype, big.device)] is buffer  # reused, not grown
            taken = threading.Event()
            release = threading.Event()

            def hold():
                with SCRATCH.dense(big):
                    taken.set()
                    release.wait(10)

            holder = threading.Thread(target=hold)
            holder.start()
            taken.wait(10)
            assert torch.equal(F.linear(x, small), F.linear(x, small_dense))  # (the buffer is taken)
            release.set()
            holder.join()
    finally:
        fp8_module.CHUNK = chunk
    with torch.no_grad():  # (the buffer, made in inference mode, outside it)
        assert torch.equal(F.linear(x, big), F.linear(x, big_dense))
    assert torch.equal(F.linear(x, big), F.linear(x, big_dense))  # grad on: a fresh tensor
    assert torch.equal(big.fmt.dequantize(big.parts, torch.bfloat16), big_dense.to(torch.bfloat16))
    out = torch.empty(72, 48, dtype=torch.bfloat16)
    big.fmt.dequantize_into(big.parts, out)
    assert torch.equal(out, big_dense.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_read_through_its_table_is_torchs_conversion_bit_for_bit(dtype):
    """Every one of the 256 codes (NaNs, zeros of both signs, subnormals, the largest), alone and
    in a weight of every code in shuffled order, as in rows sliced from a larger weight."""
    from shardnet.inference.model.fp8 import to_float32

    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    assert torch.equal(to_float32(codes).view(torch.int32), codes.float().view(torch.int32))
    order = torch.randperm(256 * 64, generator=torch.Generator().manual_seed(0)) % 256
    weight = order.to(torch.uint8).view(dtype).view(128, 128)
    for part in (weight, weight[16:48], weight[:, :64]):
        assert torch.equal(to_float32(part).view(torch.int32), part.float().view(torch.int32))
