"""Checkpoints stored in FP8 with block scales (DeepSeek-V3's, Qwen3-FP8's layout) through a
chain of real peers.

Each tiny random bf16 checkpoint gets an FP8 copy (``shardnet.testing.fp8``: the tensors
transformers' fine-grained FP8 integration converts, in small blocks; DeepSeek's 24-row
``kv_a_proj_with_mqa`` ends in a partial block, as the real 576-row one does in 128-row blocks)
and the plain bf16 checkpoint that FP8 copy stands for (every weight times its scales, written
independently of shardnet's loader). The chain serving the FP8 copy must compute what
transformers computes on that reference.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardnet.errors import CheckpointError
from shardnet.inference.client.client import Client
from shardnet.inference.model.block import Block
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.inference.model.stored import module_stored_nbytes
from shardnet.inference.server.placement import layer_bytes
from shardnet.testing.fp8 import dequantized_reference, quantize_checkpoint_fp8
from shardnet.testing.helpers import (
    EXACT_NEW_TOKENS,
    EXACT_PROMPT,
    chain_last_logits,
    chain_token_ids,
    local_chain,
    one_line,
    transformers_reference,
)

#: family -> FP8 block (rows, cols): DeepSeek-V3's and Qwen3-FP8's are square (128x128); qwen3's
#: here is not, so rows and columns of the scale grid cannot be confused unnoticed
BLOCKS = {"deepseek_v3": (16, 16), "qwen3": (8, 32), "qwen3_moe": (16, 16)}
BLOCK = (16, 16)
#: bfloat16 logits of the same weights through the same ops agree to rounding (the tolerance of
#: test_families' bf16 runs); measured here: 0.0 for all three, of logits up to ~7
BF16_LOGIT_TOL = 0.1


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (the bf16 original, its FP8 copy, the dequantized bf16 reference)."""
    root = tmp_path_factory.mktemp("fp8")
    made = {}

    def make(family):
        if family not in made:
            bf16 = init_random(root / f"{family}-bf16", family, layers=4, hidden=64, heads=4, kv_heads=2,
                               vocab=512, seed=8, dtype="bfloat16")
            fp8 = quantize_checkpoint_fp8(bf16, root / f"{family}-fp8", block=BLOCKS[family])
            made[family] = bf16, fp8, dequantized_reference(fp8, root / f"{family}-ref")
        return made[family]
    return make


@pytest.fixture
def fp8_copy(checkpoints, tmp_path):
    """A fresh FP8 qwen3 checkpoint a test may break."""
    return quantize_checkpoint_fp8(checkpoints("qwen3")[0], tmp_path / "qwen3-fp8", block=BLOCK)


@pytest.mark.parametrize("family", BLOCKS)
async def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(loopback_config, checkpoints,
                                                                           family):
    bf16, fp8, reference = checkpoints(family)
    stored = Checkpoint(fp8).entries
    assert stored["model.layers.1.self_attn.o_proj.weight"].dtype == "F8_E4M3"
    # the FP8 copy is not the original: a load that ignored the scales or the FP8 could not match
    original, dequantized = load_file(str(bf16 / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert not torch.equal(original["model.layers.1.self_attn.o_proj.weight"],
                           dequantized["model.layers.1.self_attn.o_proj.weight"])
    want_ids, want_logits = transformers_reference(reference, EXACT_PROMPT, EXACT_NEW_TOKENS, dtype=None)
    async with local_chain(loopback_config, fp8, [(0, 2), (2, 4)]) as node:
        model = LocalModel(fp8)
        assert model.dtype == torch.bfloat16
        client = Client(node, model)
        got = await chain_token_ids(client, EXACT_PROMPT, EXACT_NEW_TOKENS)
        assert [(c.start, c.end, c.dtype) for c in client.last_stats.chain] == [(0, 2, "bfloat16"),
                                                                                (2, 4, "bfloat16")]
        logits = await chain_last_logits(client, EXACT_PROMPT + got)
    assert got == want_ids
    assert torch.allclose(logits, want_logits, atol=BF16_LOGIT_TOL, rtol=0), (logits - want_logits).abs().max()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_transformers_reads_the_fp8_copy_as_the_reference(checkpoints, family):
    """transformers' own FP8 reader (on CPU it dequantizes to bf16) loads the FP8 copy to exactly
    the reference's weights: the copy is stored as transformers expects FP8 checkpoints.
    (Not DeepSeek's: transformers derives the block from the scale grid, 24 rows / 2 = 12, so a
    shape that does not divide into blocks is dequantized wrongly there; shardnet uses the
    configured block, as DeepSeek's own kernels do.)"""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")
    from transformers import AutoModelForCausalLM

    _, fp8, reference = checkpoints(family)
    theirs = AutoModelForCausalLM.from_pretrained(fp8).state_dict()
    want = AutoModelForCausalLM.from_pretrained(reference).state_dict()
    assert theirs.keys() == want.keys()
    assert all(torch.equal(theirs[k], want[k]) for k in want)


def test_fp8_checkpoint_has_its_own_model_id_and_half_the_bytes(checkpoints):
    bf16, fp8, reference = checkpoints("deepseek_v3")
    ids = {Checkpoint(p).model_id for p in (bf16, fp8, reference)}
    assert len(ids) == 3
    manifest = Checkpoint(fp8).manifest()
    assert manifest["num_layers"] == 4 and any(n.endswith("_scale_inv") for n in manifest["tensors"])

    def stored_layer_bytes(path):
        ckpt = Checkpoint(path)
        return sum(e.end - e.start for n, e in ckpt.entries.items() if n.startswith("model.layers."))

    ratio = stored_layer_bytes(fp8) / stored_layer_bytes(bf16)
    # one byte a weight, plus 4 bytes of scale per 16x16 block (1.6%) and the bf16 norms and routers
    assert 0.5 < ratio < 0.53, ratio
    # a peer holds the FP8 bytes and scales as stored (stored.py): placement sizes it so, and
    # that is what a loaded block holds
    ckpt = Checkpoint(fp8)
    for i in range(4):
        stored = sum(ckpt.entries[n].size for n in ckpt.layer_tensors(i))
        assert layer_bytes(ckpt, i, "bfloat16") == stored
        block = Block(ckpt, i, i + 1, dtype=torch.bfloat16)
        # (buffers and tensors transformers keeps in float32, such as routing biases, aside)
        assert abs(module_stored_nbytes(block.layers) - stored) < 0.02 * stored


def test_a_quantization_other_than_fp8_blocks_is_refused(fp8_copy):
    cfg = json.loads((fp8_copy / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "hqq", "nbits": 4, "group_size": 64}
    (fp8_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError,
                       match=r"stored quantization 'hqq' is not supported \(supported: .*awq.*gptq") as e:
        Checkpoint(fp8_copy)
    one_line(e.value)


def rewrite(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_first_layer(path):
    Block(Checkpoint(path), 0, 1, dtype=torch.bfloat16)


SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"  # 64x64 in 16x16 blocks: 4x4


def shrink_scale(t):
    t[SCALE] = t[SCALE][:3].contiguous()


@pytest.mark.parametrize("damage, error", [
    (shrink_scale,
     r"q_proj.weight: its scale has shape \[3, 4\], but \[64, 64\] in blocks of 16x16 needs \[4, 4\]"),
    # a scale without its weight
    (lambda t: t.pop("model.layers.0.mlp.up_proj.weight"),
     r"up_proj.weight_scale_inv scales a tensor that is not in the checkpoint"),
    # an FP8 weight without its scale: read as it is, it would be off by its scales, silently
    (lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale_inv"),
     r"up_proj.weight is stored in float8_e4m3fn but has no model.layers.0.mlp.up_proj.weight_scale_inv"),
], ids=["scale of the wrong shape", "scale without its weight", "fp8 weight without its scale"])
def test_damaged_fp8_tensors_are_refused_in_one_line(fp8_copy, damage, error):
    rewrite(fp8_copy, damage)
    with pytest.raises(CheckpointError, match=error) as e:
        load_first_layer(fp8_copy)
    one_line(e.value)
