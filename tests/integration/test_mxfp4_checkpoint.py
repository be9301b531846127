"""gpt-oss checkpoints with MXFP4 experts (OpenAI's layout) through a chain of real peers.

A tiny random bf16 gpt_oss checkpoint gets an MXFP4 copy (``shardnet.testing.mxfp4``: every
expert bank as ``*_blocks`` + ``*_scales``, the rest bf16, gpt-oss's ``quantization_config``).
The chain serving it must compute what transformers computes on its own load of that copy
(``Mxfp4Config(dequantize=True)``: on CPU transformers dequantizes the experts at load), and
each peer must hold the experts as the MXFP4 bytes.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardnet.errors import CheckpointError
from shardnet.inference.client.client import Client
from shardnet.inference.model.block import Block
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.quantize import bytes_per_param, weight_bytes
from shardnet.inference.model.random_model import init_random
from shardnet.inference.model.stored import StoredWeight, module_stored_nbytes, stored_nbytes
from shardnet.inference.server.placement import layer_bytes
from shardnet.testing.helpers import (
    EXACT_NEW_TOKENS,
    EXACT_PROMPT,
    LOGIT_TOL,
    chain_last_logits,
    chain_token_ids,
    local_chain,
    one_line,
    transformers_generate,
)
from shardnet.testing.mxfp4 import quantize_checkpoint_mxfp4

LAYERS = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the bf16 gpt_oss original, its MXFP4 copy)."""
    root = tmp_path_factory.mktemp("mxfp4")
    bf16 = init_random(root / "bf16", "gpt_oss", layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=512, seed=8,
                       dtype="bfloat16")
    return bf16, quantize_checkpoint_mxfp4(bf16, root / "mxfp4")


def transformers_own_load(path):
    """transformers' own read of the MXFP4 checkpoint in float32 (on CPU it dequantizes the
    experts as it loads: ``Mxfp4Config(dequantize=True)``)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                                dtype=torch.float32).eval()


async def test_mxfp4_gpt_oss_matches_transformers_own_load(loopback_config, checkpoints):
    bf16, mxfp4 = checkpoints
    stored = Checkpoint(mxfp4).entries
    assert stored["model.layers.1.mlp.experts.gate_up_proj_blocks"].dtype == "U8"
    assert "model.layers.1.mlp.experts.gate_up_proj" not in stored
    theirs = transformers_own_load(mxfp4)
    # transformers read the MXFP4 bytes (its experts are not the original bf16 ones)
    original = load_file(str(bf16 / "model.safetensors"))["model.layers.1.mlp.experts.down_proj"]
    assert not torch.equal(theirs.model.layers[1].mlp.experts.down_proj.data.to(torch.bfloat16), original)
    out = transformers_generate(theirs, torch.tensor([EXACT_PROMPT]), EXACT_NEW_TOKENS)
    want_ids = out[0].tolist()[len(EXACT_PROMPT):]
    with torch.inference_mode():
        want_logits = theirs(out[:, :-1]).logits[0, -1].float()
    async with local_chain(loopback_config, mxfp4, [(0, 2), (2, 4)], dtype="float32") as node:
        client = Client(node, LocalModel(mxfp4, dtype="float32"))
        got = await chain_token_ids(client, EXACT_PROMPT, EXACT_NEW_TOKENS)
        assert [(c.start, c.end, c.dtype) for c in client.last_stats.chain] == [(0, 2, "float32"), (2, 4, "float32")]
        logits = await chain_last_logits(client, EXACT_PROMPT + got)
    assert got == want_ids
    assert torch.allclose(logits, want_logits, atol=LOGIT_TOL, rtol=0), (logits - want_logits).abs().max()


def test_a_block_holds_the_mxfp4_bytes(checkpoints):
    bf16, mxfp4 = checkpoints
    ckpt = Checkpoint(mxfp4)
    for i in range(LAYERS):
        stored = sum(ckpt.entries[n].size for n in ckpt.layer_tensors(i))
        assert layer_bytes(ckpt, i, "bfloat16") == stored
        block = Block(ckpt, i, i + 1, dtype=torch.bfloat16)
        assert abs(module_stored_nbytes(block.layers) - stored) < 0.02 * stored
    experts = block.layers[0].mlp.experts
    bf16_experts = load_file(str(bf16 / "model.safetensors"))
    for proj in ("gate_up_proj", "down_proj"):
        bank = getattr(experts, proj)
        assert isinstance(bank, StoredWeight) and bank.dtype == torch.bfloat16
        original = bf16_experts[f"model.layers.{LAYERS - 1}.mlp.experts.{proj}"]
        assert bank.shape == original.shape
        # 4 bits a weight and an 8-bit exponent per 32: 4.25 bits, against bf16's 16
        assert stored_nbytes(bank) * 8 / bank.numel() == 4.25
        assert stored_nbytes(original) / stored_nbytes(bank) == pytest.approx(16 / 4.25)


def test_join_quantize_keeps_the_mxfp4_banks_and_placement_counts_them(checkpoints):
    """``--quantize int8`` quantizes the attention's Linear weights; the expert banks stay MXFP4
    (blocks and scales), and placement counts them so."""
    original, ckpt = (Checkpoint(p) for p in checkpoints)
    block = Block(ckpt, 0, 1, dtype=torch.bfloat16, quantize="int8")
    experts = block.layers[0].mlp.experts
    assert type(block.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    banks = sum(ckpt.entries[n].size for n in ckpt.layer_tensors(0) if n.endswith(("_blocks", "_scales")))
    assert stored_nbytes(experts.gate_up_proj) + stored_nbytes(experts.down_proj) == banks
    # the layers differ only by their banks (the bf16 original's quantized as 8-bit groups)
    bf16_banks = sum(math.prod(shape) * bytes_per_param("int8", 2, in_features=min(shape[1:]), expert=True)
                     for shape in (original.catalog[n].shape for n in original.layer_tensors(0) if n.endswith("_proj")))
    assert layer_bytes(ckpt, 0, "bfloat16", "int8") - layer_bytes(original, 0, "bfloat16", "int8") == \
        pytest.approx(banks - bf16_banks, abs=2)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_placement_counts_quantized_bf16_banks_as_held(checkpoints, mode):
    """``--quantize`` makes 8- or 4-bit groups of gpt-oss's bf16 expert banks: placement's bytes
    are what the block holds (at most the worst case of the groups above)."""
    original = Checkpoint(checkpoints[0])
    block = Block(original, 0, 1, dtype=torch.bfloat16, quantize=mode)
    held, counted = weight_bytes(block.layers), layer_bytes(original, 0, "bfloat16", mode)
    assert held <= counted <= 1.2 * held, (held, counted)


@pytest.fixture
def mxfp4_copy(checkpoints, tmp_path):
    """A fresh MXFP4 checkpoint a test may break."""
    return quantize_checkpoint_mxfp4(checkpoints[0], tmp_path / "mxfp4")


BLOCKS = "model.layers.0.mlp.experts.down_proj_blocks"
SCALES = "model.layers.0.mlp.experts.down_proj_scales"


def shrink_scales(t):
    t[SCALES] = t[SCALES][:, :, :1].contiguous()


@pytest.mark.parametrize("damage, error", [
    (lambda t: t.pop(SCALES), r"down_proj_blocks is MXFP4 but has no model.layers.0.mlp.experts.down_proj_scales"),
    (lambda t: t.pop(BLOCKS), r"down_proj_scales scales MXFP4 blocks that are not in the checkpoint"),
    (shrink_scales, r"down_proj_blocks: MXFP4 blocks \[..., O, I/32, 16\] need scales \[..., O, I/32\]; got "
                    r"\[4, 64, 4, 16\] and \[4, 64, 1\]"),
], ids=["blocks without scales", "scales without blocks", "scales of the wrong shape"])
def test_damaged_mxfp4_tensors_are_refused_in_one_line(mxfp4_copy, damage, error):
    tensors = load_file(str(mxfp4_copy / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(mxfp4_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=error) as e:
        Block(Checkpoint(mxfp4_copy), 0, 1, dtype=torch.bfloat16)
    one_line(e.value)


def test_a_malformed_mxfp4_config_is_refused_in_one_line(mxfp4_copy):
    cfg = json.loads((mxfp4_copy / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = "lm_head"
    (mxfp4_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="modules_to_not_convert must be a list of module names") as e:
        Checkpoint(mxfp4_copy)
    one_line(e.value)
