"""Weight quantization of one real transformers decoder layer (shardnet.inference.model.quantize).

Tolerances: a layer's update (output minus input, what the layer adds to the residual stream) may
differ from the unquantized layer's, computed in the same dtype on the same input, by at most
MAX_REL_ERROR[mode, dtype] times the update's largest magnitude. Measured on these layers: int8
0.011 (float32) and 0.057 (bfloat16, mostly bfloat16's own rounding of the output), int4 0.17
and 0.20 (random weights are the worst case for 4 bits: no outliers to spare)."""

import copy

import pytest
import torch

from shardnet.errors import ShardnetError
from shardnet.inference.model.quantize import (
    QUANT_MODES,
    QuantizationError,
    bytes_per_param,
    quantize_module,
    weight_bytes,
)
from shardnet.inference.model.stored import StoredWeight, stored_nbytes

pytestmark = pytest.mark.unit

MAX_REL_ERROR = {
    ("int8", torch.float32): 0.03, ("int8", torch.bfloat16): 0.1, ("int8", torch.float16): 0.03,
    ("int4", torch.float32): 0.3, ("int4", torch.bfloat16): 0.35, ("int4", torch.float16): 0.3,
}
HIDDEN, TOKENS = 256, 6


@pytest.fixture(scope="module")
def layers():
    """First decoder layer, rotary module and config of a tiny random llama and mixtral, built by
    transformers (its own initialisation; mixtral's experts run grouped_mm, the default)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    built = {}
    for family, extra in (("llama", {}), ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2})):
        config = AutoConfig.for_model(family, vocab_size=64, hidden_size=HIDDEN, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                                      **extra)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        built[family] = (model.model.layers[0], model.model.rotary_emb, model.config)
    return built


def layer_update(layer, rotary, x: torch.Tensor) -> torch.Tensor:
    """What the layer adds to ``x``, run as Block runs it (under inference_mode)."""
    position_ids = torch.arange(x.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        out = layer(x, attention_mask=None, position_ids=position_ids,
                    position_embeddings=rotary(x, position_ids))
        out = out[0] if isinstance(out, tuple) else out
        return (out - x).float()


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", QUANT_MODES)
def test_quantized_layer_matches_unquantized(layers, family, dtype, mode):
    layer, rotary, config = layers[family]
    layer = copy.deepcopy(layer).to(dtype)
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    reference = layer_update(layer, rotary, x)
    unquantized_bytes = weight_bytes(layer)

    quantize_module(layer, mode)

    quantized = {n: type(p).__name__ for n, p in layer.named_parameters() if p.dim() >= 2}
    assert quantized["self_attn.q_proj.weight"] == ("Int8Tensor" if mode == "int8" else "Int4OpaqueTensor")
    if family == "mixtral":
        # expert banks: torchao's int8, or 4-bit IntGroups kept packed; the router stays in the compute dtype
        bank = "Int8Tensor" if mode == "int8" else "StoredWeight"
        assert quantized["mlp.experts.gate_up_proj"] == quantized["mlp.experts.down_proj"] == bank
        if mode == "int4":
            experts = layer.mlp.experts
            held = stored_nbytes(experts.gate_up_proj) + stored_nbytes(experts.down_proj)
            params = experts.gate_up_proj.numel() + experts.down_proj.numel()
            assert held / params == pytest.approx(bytes_per_param("int4", dtype.itemsize, in_features=HIDDEN,
                                                                  expert=True), rel=0.2)
        assert quantized["mlp.gate.weight"] == "Parameter"
        # only this layer's experts switched to the per-expert loop, not the model's config
        assert layer.mlp.experts.config._experts_implementation == "eager"
        assert config._experts_implementation == "grouped_mm"
    error = (layer_update(layer, rotary, x) - reference).abs().max().item()
    assert error <= MAX_REL_ERROR[mode, dtype] * reference.abs().max().item()

    ratio = weight_bytes(layer) / unquantized_bytes
    if dtype == torch.bfloat16 and mode == "int8":
        assert 0.45 < ratio < 0.55, ratio  # int8 is about half of bf16
    elif dtype == torch.float32:
        assert ratio < (0.3 if mode == "int8" else 0.27), ratio
    if mode == "int4" and family == "llama":
        assert ratio < 0.3 if dtype != torch.float32 else ratio < 0.16, ratio


def test_bytes_per_param_is_what_a_linear_takes():
    for mode in QUANT_MODES:
        for dtype in (torch.float32, torch.bfloat16):
            for in_features in (1024, 224):
                linear = torch.nn.Linear(in_features, 512, bias=False).to(dtype)
                quantize_module(linear, mode)
                per_param = weight_bytes(linear) / (512 * in_features)
                assert per_param == pytest.approx(bytes_per_param(mode, dtype.itemsize, in_features=in_features))
                # without the width it plans for the worst case, never less
                assert bytes_per_param(mode, dtype.itemsize) >= per_param - 0.02
    assert bytes_per_param(None, 2) == 2.0
    # expert banks are 4-bit in int4 too (IntGroups): about half of int8's bytes
    assert bytes_per_param("int4", 2, in_features=1024, expert=True) < 0.6 * bytes_per_param("int8", 2)


def test_weight_bytes_unquantized_is_parameter_bytes():
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    assert weight_bytes(linear) == (64 * 32 + 32) * 2


def test_quantizing_twice_leaves_weights_as_they_are():
    linear = torch.nn.Linear(256, 64)
    quantize_module(linear, "int8")
    weight = linear.weight
    quantize_module(linear, "int4")
    assert linear.weight is weight


def test_refusals_are_one_line_shardnet_errors():
    with pytest.raises(QuantizationError, match=r"^unknown quantization 'int3' \(choose from int8, int4\)$"):
        quantize_module(torch.nn.Linear(64, 64), "int3")
    with pytest.raises(ShardnetError, match=r"^int8 quantization runs on cpu and cuda, not meta$"):
        quantize_module(torch.nn.Linear(64, 64, device="meta"), "int8")
    with pytest.raises(QuantizationError) as refused:
        bytes_per_param("fp3", 2)
    assert "\n" not in str(refused.value) and refused.value.code == "quantization"


@pytest.mark.parametrize("bits", [4, 8])
def test_a_bank_as_int_groups_is_close_to_the_bank_and_an_expert_runs_alone(bits):
    """``quantize_bank``: gpt-oss's transposed banks ([E, in, out], used as ``x @ bank[e]``) and
    the usual [E, out, in] ones; one expert's product equals its dequantized slice's."""
    from shardnet.inference.model.quantize import quantize_bank

    g = torch.Generator().manual_seed(3)
    for transposed in (False, True):
        bank = torch.randn(4, 256, 96, generator=g).to(torch.bfloat16)
        stored = quantize_bank(bank, bits, transposed=transposed)
        assert type(stored) is StoredWeight and stored.shape == bank.shape and stored.dtype == bank.dtype
        x = torch.randn(3, bank.shape[1] if transposed else bank.shape[2], generator=g).to(torch.bfloat16)
        for e in range(4):
            dense = stored.dequantize()[e]
            got = x @ stored[e] if transposed else torch.nn.functional.linear(x, stored[e])
            want = x @ dense if transposed else torch.nn.functional.linear(x, dense)
            assert torch.equal(got, want)
        error = (stored.dequantize().float() - bank.float()).abs().max() / bank.float().abs().max()
        assert error < (0.1 if bits == 4 else 0.01), error
        assert stored_nbytes(stored) <= bank.numel() * (0.625 if bits == 4 else 1.1)  # (groups of 32 here)


def test_int_groups_dequantized_into_a_buffer_a_few_rows_at_a_time_are_the_same_bits():
    from shardnet.inference.model.quantize import quantize_bank

    bank = torch.randn(3, 2500, 640, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for bits in (4, 8):
        stored = quantize_bank(bank, bits)
        out = torch.empty(2500, 640, dtype=torch.bfloat16)
        stored.fmt.dequantize_into(stored[2].parts, out)  # (1638 rows a piece: two, the last short)
        assert torch.equal(out, stored.dequantize()[2])


@pytest.mark.parametrize("mode", QUANT_MODES)
def test_parameters_left_unquantized_no_longer_share_the_loaded_storage(layers, mode):
    """A norm loaded from safetensors is a view of the file's mapping: kept as such, it kept every
    page the quantized weights were read from resident. After quantization it is a copy."""
    layer = copy.deepcopy(layers["llama"][0])
    mapping = torch.zeros(HIDDEN * 4)  # stands for the file's mapping
    norm = layer.input_layernorm
    mapping[:HIDDEN] = norm.weight.detach()
    norm.weight = torch.nn.Parameter(mapping[:HIDDEN], requires_grad=False)
    quantize_module(layer, mode)
    assert norm.weight.untyped_storage().data_ptr() != mapping.untyped_storage().data_ptr()
    assert torch.equal(norm.weight, mapping[:HIDDEN])


def test_the_swarm_simulation_assumes_no_fewer_bytes_than_int4_holds():
    """docs/scale.md simulates its models at ``BYTES_PER_PARAM`` (4.5 bits a parameter): ``join
    --quantize int4`` must hold them in no more, dense and expert weights alike (bf16 scales)."""
    from bench.swarm_sim.models import BYTES_PER_PARAM

    for hidden in (7168, 8192, 2048):  # DeepSeek-V3's and Llama 70B's input widths, an expert's
        for expert in (False, True):
            assert bytes_per_param("int4", 2, in_features=hidden, expert=expert) <= BYTES_PER_PARAM
