"""MXFP4 expert banks (gpt-oss's layout): dequantized as transformers dequantizes them, bit for
bit; kept as the packed bytes, one expert dequantized per call."""

import pytest
import torch
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from shardnet.errors import CheckpointError
from shardnet.inference.model import mxfp4
from shardnet.inference.model.stored import StoredWeight, stored_nbytes
from shardnet.testing.helpers import one_line
from shardnet.testing.mxfp4 import quantize_checkpoint_mxfp4, quantize_mxfp4

E, OUT, IN = 3, 40, 96  # a bank [E, IN, OUT] stored as [E, OUT, IN/32, 16] and [E, OUT, IN/32]
NAME = "model.layers.0.mlp.experts.gate_up_proj"


def packed(seed=0, exponents=(-127, 127)):
    """Random MXFP4 bytes: every code; by default every exponent but E8M0's NaN (255)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, OUT, IN // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 + exponents[0], 128 + exponents[1], (E, OUT, IN // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def bank(dtype=torch.float32, seed=0, exponents=(-127, 127)):
    blocks, scales = packed(seed, exponents)
    return mxfp4.to_stored({NAME + "_blocks": blocks, NAME + "_scales": scales, "bias": torch.ones(3)}, {},
                           dtype), blocks, scales


def test_the_value_table_is_transformers():
    assert list(mxfp4.FP4_VALUES) == FP4_VALUES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_bank_dequantizes_as_transformers_does_bit_for_bit(dtype):
    tensors, blocks, scales = bank(dtype)
    w = tensors[NAME]
    assert isinstance(w, StoredWeight) and tuple(w.shape) == (E, IN, OUT) and w.dtype == dtype
    assert set(tensors) == {NAME, "bias"}
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, IN, OUT]
    got = w.dequantize()
    assert got.dtype == dtype and got.stride() == want.stride()
    assert torch.equal(got.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                       want.view(torch.int16 if dtype.itemsize == 2 else torch.int32))  # signed zeros, infs


def test_one_expert_is_its_slice_and_computes_as_the_dense_bank():
    tensors, blocks, scales = bank(exponents=(-8, 2))  # finite products
    w, dense = tensors[NAME], convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    x = torch.randn(5, IN)
    for e in range(E):
        one = w[torch.tensor(e)]  # transformers' expert loop indexes with a 0-dim tensor
        assert isinstance(one, StoredWeight) and stored_nbytes(one) == stored_nbytes(w) // E
        assert torch.equal(one.dequantize(), dense[e])
        assert torch.equal(x @ one, x @ dense[e])
    # transformers' grouped_mm experts: rows sorted by expert, expert 1 without any
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    assert torch.equal(torch._grouped_mm(x, w, offs=offs), torch._grouped_mm(x, dense, offs=offs))


def test_the_bank_holds_4_25_bits_a_weight():
    w = bank()[0][NAME]
    assert stored_nbytes(w) == E * OUT * IN // 2 + E * OUT * IN // 32
    assert stored_nbytes(w) * 8 / w.numel() == 4.25


def test_the_quantizer_writes_what_transformers_reads_back_to_the_nearest_value():
    w = torch.randn(E, OUT, IN) * torch.logspace(-3, 1, OUT)[:, None]
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (E, OUT, IN // 32, 16) and scales.shape == (E, OUT, IN // 32)
    back = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).mT  # [E, OUT, IN]
    step = torch.ldexp(torch.ones(scales.shape), scales.int() - 127).repeat_interleave(32, -1)  # 2^e
    # within half the spacing of the E2M1 values around it (0.5, 1 or 2 units of 2^e)
    spacing = torch.where(back.abs() / step < 2, 0.5, torch.where(back.abs() / step < 4, 1.0, 2.0)) * step
    assert ((back - w).abs() <= spacing / 2).all()
    # each block's largest value is kept within a quarter of itself (its scale is the smallest
    # that fits it)
    amax = w.reshape(E, OUT, -1, 32).abs().amax(-1)
    assert ((back.reshape(E, OUT, -1, 32).abs().amax(-1) - amax).abs() <= amax / 4).all()
    # what it wrote is stable: quantizing the read-back values gives them again
    assert torch.equal(convert_moe_packed_tensors(*quantize_mxfp4(back), dtype=torch.float32).mT, back)


def test_the_quantizer_rounds_ties_to_the_even_code():
    # with a block max of 6 (scale 2^0): 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 2.5 -> 2, 5 -> 4
    w = torch.zeros(1, 32)
    w[0, :6] = torch.tensor([6.0, 0.25, 0.75, 1.25, 2.5, -5.0])
    back = convert_moe_packed_tensors(*[t[None] for t in quantize_mxfp4(w)], dtype=torch.float32)[0].mT
    assert back[0, :6].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, -4.0]


def test_other_tensors_pass_through_and_bytes_count_as_stored():
    class Info:
        shape = (E, OUT, IN // 32, 16)
    assert mxfp4.held_bytes(NAME + "_blocks", Info, 2, {}) == E * OUT * IN // 2
    Info.shape = (E, OUT)
    assert mxfp4.held_bytes(NAME + "_bias", Info, 2, {}) == E * OUT * 2
    assert mxfp4.parse({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}) == {}


@pytest.mark.parametrize("tensors, error", [
    (lambda b, s: {NAME + "_blocks": b}, "gate_up_proj_blocks is MXFP4 but has no " + NAME + "_scales"),
    (lambda b, s: {NAME + "_scales": s}, "gate_up_proj_scales scales MXFP4 blocks that are not in the checkpoint"),
    (lambda b, s: {NAME + "_blocks": b.int(), NAME + "_scales": s},
     "gate_up_proj_blocks: MXFP4 blocks and scales are uint8, not int32 and uint8"),
    (lambda b, s: {NAME + "_blocks": b[..., :8], NAME + "_scales": s},
     r"MXFP4 blocks \[..., O, I/32, 16\] need scales \[..., O, I/32\]; got \[3, 40, 3, 8\] and \[3, 40, 3\]"),
], ids=["blocks without scales", "scales without blocks", "not uint8", "wrong shape"])
def test_damaged_mxfp4_tensors_are_refused_in_one_line(tensors, error):
    with pytest.raises(CheckpointError, match=error) as e:
        mxfp4.to_stored(tensors(*packed()), {}, torch.float32)
    one_line(e.value)


def test_writer_refusals_are_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match="gpt-oss's layout: it needs --family gpt_oss, not 'llama'") as e:
        quantize_checkpoint_mxfp4(tmp_path, tmp_path / "out")
    one_line(e.value)
    (tmp_path / "config.json").write_text('{"model_type": "gpt_oss", "hidden_size": 48, "intermediate_size": 64}')
    with pytest.raises(CheckpointError, match="MXFP4 needs a hidden_size that is a multiple of 32, not 48") as e:
        quantize_checkpoint_mxfp4(tmp_path, tmp_path / "out")
    one_line(e.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="MXFP4 needs a multiple of 32 inputs, not 40"):
        quantize_mxfp4(torch.ones(2, 40))
    with pytest.raises(CheckpointError, match="modules_to_not_convert must be a list") as e:
        mxfp4.parse({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"})
    one_line(e.value)
