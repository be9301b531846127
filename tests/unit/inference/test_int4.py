"""4-bit group-quantized weights (shardnet/inference/model/int4.py): GPTQ, AWQ and
compressed-tensors' pack-quantized read exactly as their own tools read them, kept as stored
(stacked into expert banks, gate and up joined), and unsupported variants refused in one line.

GPTQ and AWQ are checked against a readable element-by-element loop written here from their
layouts; compressed-tensors against the package's own decompressor."""

import pytest
import torch
import torch.nn.functional as F

from shardnet.errors import CheckpointError
from shardnet.inference.model.formats import stored_quant
from shardnet.inference.model.int4 import AWQ_ORDER, to_stored
from shardnet.inference.model.stored import StoredWeight, stored_nbytes
from shardnet.testing.helpers import one_line
from shardnet.testing.int4 import awq_tensors, ct_scheme, ct_tensors, gptq_tensors

GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
               "checkpoint_format": "gptq"}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def ct_config(group_size=32, symmetric=True, **weights):
    args = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group" if group_size else "channel",
            "group_size": group_size, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}, "ignore": ["lm_head"]}


def nibble(word: int, j: int) -> int:
    return (int(word) >> (4 * j)) & 15


def gptq_loop(t, group_size, zeros_minus_one=True):
    """W[o][i] = (q - zero) * scale, read one element at a time from GPTQ's layout."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    in_f, out_f = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(out_f, in_f)
    for o in range(out_f):
        for i in range(in_f):
            g = i // group_size
            q = nibble(qweight[i // 8, o], i % 8)
            zero = nibble(qzeros[g, o // 8], o % 8)
            zero = (zero + 1) & 15 if zeros_minus_one else zero
            w[o, i] = (q - zero) * float(scales[g, o])
    return w


def awq_loop(t, group_size):
    """The same from AWQ's layout: column o of its eight in nibble AWQ_ORDER.index(o % 8)."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
    w = torch.empty(out_f, in_f)
    for o in range(out_f):
        j = AWQ_ORDER.index(o % 8)
        for i in range(in_f):
            g = i // group_size
            w[o, i] = (nibble(qweight[i, o // 8], j) - nibble(qzeros[g, o // 8], j)) * float(scales[g, o])
    return w


def stored(config, tensors, name="m.weight", dtype=torch.float32):
    """``tensors`` (a linear's parts, unprefixed) as to_stored keeps them."""
    base = name.removesuffix(".weight")
    params = stored_quant({"quantization_config": config}).params
    return to_stored({f"{base}.{k}": v for k, v in tensors.items()}, params, dtype)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_dequantizes_as_its_layout_reads(group_size, sym):
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(group_size))
    t = gptq_tensors(w, group_size, sym)
    got = stored({**GPTQ_CONFIG, "group_size": group_size, "sym": sym}, t)["m.weight"]
    assert isinstance(got, StoredWeight) and got.shape == (24, 128)
    assert torch.equal(got.dequantize(), gptq_loop(t, group_size))
    # the round-to-nearest writer is close to the weight: within a scale (a group's range / 15)
    assert (got.dequantize() - w).abs().max() < w.abs().max() / 7


def test_gptq_v1_stores_zero_minus_one_and_v2_the_zero():
    t = gptq_tensors(torch.randn(16, 64, generator=torch.Generator().manual_seed(1)), 32, sym=False)
    t["qzeros"][0, 0] = -1  # every nibble 15: v1's zero 0 (AutoGPTQ: (15 + 1) & 15)
    v1 = stored({**GPTQ_CONFIG, "sym": False}, t)["m.weight"].dequantize()
    v2 = stored({**GPTQ_CONFIG, "sym": False, "checkpoint_format": "gptq_v2"}, t)["m.weight"].dequantize()
    assert torch.equal(v1, gptq_loop(t, 32)) and torch.equal(v2, gptq_loop(t, 32, zeros_minus_one=False))
    assert not torch.equal(v1, v2)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_dequantizes_as_its_layout_reads(group_size):
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(group_size))
    t = awq_tensors(w, group_size)
    got = stored({**AWQ_CONFIG, "group_size": group_size}, t)["m.weight"]
    assert torch.equal(got.dequantize(), awq_loop(t, group_size))
    assert (got.dequantize() - w).abs().max() < w.abs().max() / 7


@pytest.mark.parametrize("group_size, symmetric, in_f", [(32, True, 128), (128, True, 256), (64, False, 128),
                                                         (None, True, 100), (None, False, 100)],
                         ids=["group32", "group128", "group64-asymmetric", "channel-odd-width",
                              "channel-asymmetric"])
def test_compressed_tensors_dequantizes_as_its_decompressor(group_size, symmetric, in_f):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    scheme = ct_scheme(group_size, symmetric)
    t = ct_tensors(torch.randn(44, in_f, generator=torch.Generator().manual_seed(in_f)).bfloat16(), scheme)
    assert ("weight_zero_point" in t) == (not symmetric)
    theirs = PackedQuantizationCompressor.decompress(dict(t), scheme)["weight"]  # in the scales' dtype, bf16
    got = stored(ct_config(group_size, symmetric), t, dtype=torch.bfloat16)["m.weight"]
    assert got.shape == (44, in_f) and got.dequantize().dtype == torch.bfloat16
    assert torch.equal(got.dequantize(), theirs)
    # held as stored: the weight's shape is kept by the StoredWeight, not as a tensor
    assert stored_nbytes(got) == sum(v.numel() * v.element_size() for k, v in t.items() if k != "weight_shape")


def expert_parts(method, seed, out_f=32, in_f=64):
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
    if method == "gptq":
        return GPTQ_CONFIG, gptq_tensors(w, 32, True)
    if method == "awq":
        return AWQ_CONFIG, awq_tensors(w, 32)
    return ct_config(32, False), ct_tensors(w.bfloat16(), ct_scheme(32, False))


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_expert_banks_stack_and_gate_up_join_along_out_stay_stored(method):
    """transformers' MoE key conversion: per-expert weights stacked into banks, gate and up banks
    joined along out (qwen3_moe's gate_up_proj); a bank's expert runs as its own weight."""
    gate, up = [], []
    for e in range(3):
        config, g = expert_parts(method, 2 * e)
        gate.append(stored(config, g)["m.weight"])
        up.append(stored(config, expert_parts(method, 2 * e + 1)[1])["m.weight"])
    bank = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
    assert isinstance(bank, StoredWeight) and bank.shape == (3, 64, 64)
    assert stored_nbytes(bank) == sum(stored_nbytes(w) for w in gate + up)
    want = torch.cat([torch.stack([w.dequantize() for w in gate]), torch.stack([w.dequantize() for w in up])], 1)
    assert torch.equal(bank.dequantize(), want)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(F.linear(x, bank[1]), F.linear(x, want[1]))


def test_joining_along_in_falls_back_to_dense():
    config, t = expert_parts("gptq", 0)
    w = stored(config, t)["m.weight"]
    joined = torch.cat([w, w], dim=1)
    assert not isinstance(joined, StoredWeight) and torch.equal(joined, torch.cat([w.dequantize()] * 2, 1))


def test_biases_and_unquantized_tensors_pass_through_and_companions_are_dropped():
    t = gptq_tensors(torch.randn(16, 64), 32, True)
    out = stored(GPTQ_CONFIG, {**t, "bias": torch.ones(16)})
    assert set(out) == {"m.weight", "m.bias"}


@pytest.mark.parametrize("config, error", [
    ({**GPTQ_CONFIG, "bits": 8}, r"'gptq' is supported as 4 bits, .* not bits 8"),
    ({**GPTQ_CONFIG, "checkpoint_format": "marlin"}, r"'gptq' is supported as .* not checkpoint_format 'marlin'"),
    ({**AWQ_CONFIG, "bits": 3}, r"'awq' is supported as 4 bits, version gemm, zero_point true, not bits 3"),
    ({**AWQ_CONFIG, "version": "gemv"}, r"'awq' .* not version 'gemv'"),
    ({**AWQ_CONFIG, "zero_point": False}, r"'awq' .* not zero_point false"),
    ({**ct_config(), "format": "float-quantized"}, r"'compressed-tensors' is supported as format pack-quantized.* not "
                                                   r"format 'float-quantized'"),
    (ct_config(num_bits=8), r"not config group 'group_0': int 8-bit weights"),
    (ct_config(strategy="tensor"), r"not config group 'group_0': .*strategy 'tensor'"),
    (ct_config(actorder="group"), r"not config group 'group_0': .*actorder 'group'"),
], ids=["gptq-8bit", "gptq-marlin", "awq-3bit", "awq-gemv", "awq-no-zero-point", "ct-fp8", "ct-int8",
        "ct-per-tensor", "ct-act-order"])
def test_unsupported_variants_are_refused_in_one_line(config, error):
    with pytest.raises(CheckpointError, match=error) as e:
        stored_quant({"quantization_config": config})
    one_line(e.value)


def test_act_order_g_idx_and_damaged_parts_are_refused_in_one_line():
    t = gptq_tensors(torch.randn(16, 64), 32, True)
    with pytest.raises(CheckpointError, match=r"m.g_idx permutes the groups \(act-order, desc_act true\)") as e:
        stored({**GPTQ_CONFIG, "desc_act": True}, {**t, "g_idx": t["g_idx"].flip(0)})
    one_line(e.value)
    with pytest.raises(CheckpointError, match=r"m.scales has shape \[1, 16\], but a 16x64 weight in groups of 32 "
                                              r"needs \[2, 16\]") as e:
        stored(GPTQ_CONFIG, {**t, "scales": t["scales"][:1]})
    one_line(e.value)
    with pytest.raises(CheckpointError, match=r"m.qweight must be int32 \(packed 4-bit values\), not int64") as e:
        stored(GPTQ_CONFIG, {**t, "qweight": t["qweight"].long()})
    one_line(e.value)
    with pytest.raises(CheckpointError, match=r"m.qzeros accompanies m.qweight, which is not in the checkpoint"):
        stored(GPTQ_CONFIG, {"qzeros": t["qzeros"]})


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_dequantized_into_a_buffer_a_few_rows_at_a_time_the_same_bits(method, monkeypatch):
    """``dequantize_into`` (what a stored weight's linear writes into the reused buffer): pieces
    of 16 output rows here, the last one short, the packed zeros (and AWQ's packed weights) cut
    at their int32s; a bank's expert too."""
    from shardnet.inference.model import stored as stored_module

    out_f = 44 if method == "compressed-tensors" else 40  # (GPTQ's and AWQ's writers: 8 rows an int32)
    w = torch.randn(out_f, 128, generator=torch.Generator().manual_seed(3))
    if method == "gptq":
        config, t = {**GPTQ_CONFIG, "sym": False}, gptq_tensors(w, 32, False)
    elif method == "awq":
        config, t = AWQ_CONFIG, awq_tensors(w, 32)
    else:
        config, t = ct_config(32, False), ct_tensors(w.bfloat16(), ct_scheme(32, False))
    weight = stored(config, t, dtype=torch.bfloat16)["m.weight"]
    calls = []
    rows = stored_module.dequantize_rows

    def small_steps(dequantize, parts, out, per, step, dims=None):
        calls.append(step)
        return rows(dequantize, parts, out, per, 16, dims)

    monkeypatch.setattr("shardnet.inference.model.int4.dequantize_rows", small_steps)
    out = torch.empty(out_f, 128, dtype=torch.bfloat16)
    weight.fmt.dequantize_into(weight.parts, out)
    assert calls and torch.equal(out, weight.dequantize())
    bank = torch.stack([weight, weight])
    bank.fmt.dequantize_into(bank[1].parts, out)
    assert torch.equal(out, bank.dequantize()[1])
