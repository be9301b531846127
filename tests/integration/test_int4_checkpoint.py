"""Checkpoints stored in 4 bits with group scales (GPTQ, AWQ, compressed-tensors pack-quantized)
through a chain of real peers.

Each tiny random bf16 checkpoint gets a 4-bit copy (``shardnet.testing.int4``: GPTQ and AWQ by
round-to-nearest into exactly their layouts, compressed-tensors by its own package). The chain
serving the copy must compute what transformers computes:

- compressed-tensors (symmetric): transformers' own load of the copy (through the compressed-tensors package;
  on CPU it keeps the packed weights and decompresses them in its forward), both in float32,
  where that decompression is exact (4-bit integers times bf16 scales);
- GPTQ and AWQ (transformers reads them only with GPU packages), asymmetric compressed-tensors and
  the MoE copies: the plain bf16 checkpoint the copy
  stands for, dequantized independently of shardnet's loader (``int4_dequantized_reference``).
"""

import pytest
import torch
from safetensors.torch import load_file

from shardnet.inference.client.client import Client
from shardnet.inference.model.block import Block, Head
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.inference.model.stored import StoredWeight, module_stored_nbytes
from shardnet.inference.server.placement import layer_bytes
from shardnet.testing.helpers import (
    EXACT_NEW_TOKENS,
    EXACT_PROMPT,
    chain_last_logits,
    chain_token_ids,
    local_chain,
    transformers_reference,
)
from shardnet.testing.int4 import int4_dequantized_reference, write_awq, write_compressed_tensors, write_gptq

#: method -> its writer, in the variants the tests use (GPTQ asymmetric: v1's zero - 1 matters)
WRITERS = {
    "gptq": lambda src, dst: write_gptq(src, dst, group_size=32, sym=False),
    "gptq-lm-head": lambda src, dst: write_gptq(src, dst, group_size=32, sym=False, lm_head=True),
    "gptq-sym": lambda src, dst: write_gptq(src, dst, group_size=64, sym=True),
    "awq": lambda src, dst: write_awq(src, dst, group_size=32),
    "compressed-tensors": lambda src, dst: write_compressed_tensors(src, dst, group_size=32),
    "compressed-tensors-channel-asym": lambda src, dst: write_compressed_tensors(src, dst, group_size=None,
                                                                                symmetric=False),
}
#: the fp8 test's tolerance for bf16 logits of the same weights through the same ops
BF16_LOGIT_TOL = 0.1
#: float32 logits of the same weights: summation order only
F32_LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(variant, family) -> (the bf16 original, its 4-bit copy, the dequantized bf16 reference)."""
    root = tmp_path_factory.mktemp("int4")
    made = {}

    def make(variant, family):
        if family not in made:
            made[family] = init_random(root / f"{family}-bf16", family, layers=4, hidden=64, heads=4, kv_heads=2,
                                       vocab=512, seed=8, dtype="bfloat16")
        if (variant, family) not in made:
            copy = WRITERS[variant](made[family], root / f"{family}-{variant}")
            made[variant, family] = made[family], copy, int4_dequantized_reference(copy, root / f"{family}-{variant}-ref")
        return made[variant, family]
    return make


async def chain_run(loopback_config, path, dtype):
    async with local_chain(loopback_config, path, [(0, 2), (2, 4)], dtype=dtype) as node:
        client = Client(node, LocalModel(path, dtype=dtype))
        got = await chain_token_ids(client, EXACT_PROMPT, EXACT_NEW_TOKENS)
        assert [(c.start, c.end, c.dtype) for c in client.last_stats.chain] == [(0, 2, dtype), (2, 4, dtype)]
        return got, await chain_last_logits(client, EXACT_PROMPT + got)


@pytest.mark.parametrize("variant, family", [("gptq", "llama"), ("gptq-lm-head", "llama"), ("gptq-sym", "qwen3_moe"), ("awq", "llama"),
                                             ("awq", "qwen3_moe"), ("compressed-tensors", "qwen3_moe"),
                                             ("compressed-tensors-channel-asym", "llama")])
async def test_int4_checkpoint_matches_transformers_on_its_dequantized_weights(loopback_config, checkpoints,
                                                                             variant, family):
    bf16, copy, reference = checkpoints(variant, family)
    # the copy is not the original: a load that ignored scales or zero points could not match
    original, dequantized = load_file(str(bf16 / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    assert not torch.equal(original[name], dequantized[name])
    want_ids, want_logits = transformers_reference(reference, EXACT_PROMPT, EXACT_NEW_TOKENS, dtype=None)
    got, logits = await chain_run(loopback_config, copy, "bfloat16")
    assert got == want_ids
    assert torch.allclose(logits, want_logits, atol=BF16_LOGIT_TOL, rtol=0), (logits - want_logits).abs().max()


async def test_compressed_tensors_checkpoint_matches_transformers_own_load(loopback_config, checkpoints):
    """(Symmetric only: transformers 5.25 with compressed-tensors 0.20.1 does not read the packed
    zero points of an asymmetric pack-quantized checkpoint, [out/8, groups], into its [out,
    groups] parameters: it reinitializes them. That variant is compared with its reference above.)"""
    _, copy, _ = checkpoints("compressed-tensors", "llama")
    want_ids, want_logits = transformers_reference(copy, EXACT_PROMPT, EXACT_NEW_TOKENS, dtype="float32")
    got, logits = await chain_run(loopback_config, copy, "float32")
    assert got == want_ids
    assert torch.allclose(logits, want_logits, atol=F32_LOGIT_TOL, rtol=0), (logits - want_logits).abs().max()


@pytest.mark.parametrize("variant", ["gptq", "awq", "compressed-tensors"])
def test_a_loaded_block_holds_the_stored_bytes(checkpoints, variant):
    """Every quantized weight, expert banks with gate and up joined included, stays stored: a
    block holds the packed weights, zeros and scales (not GPTQ's trivial g_idx nor
    compressed-tensors' weight_shape, read and dropped), which placement counts."""
    bf16, copy, _ = checkpoints(variant, "qwen3_moe")
    ckpt, plain = Checkpoint(copy), Checkpoint(bf16)
    for i in range(4):
        dropped = sum(ckpt.entries[n].size for n in ckpt.layer_tensors(i) if n.endswith((".g_idx", ".weight_shape")))
        stored = sum(ckpt.entries[n].size for n in ckpt.layer_tensors(i)) - dropped
        assert layer_bytes(ckpt, i, "bfloat16") == stored
        block = Block(ckpt, i, i + 1, dtype=torch.bfloat16)
        assert abs(module_stored_nbytes(block.layers) - stored) < 0.02 * stored
        weights = {n: p for n, p in block.layers.named_parameters() if p.dim() >= 2 and "mlp.gate." not in n}
        assert weights and all(isinstance(p, StoredWeight) for p in weights.values()), \
            [n for n, p in weights.items() if not isinstance(p, StoredWeight)]
        # 4 bits a weight, plus a scale (and zero) per 32 of them; norms and the router in bf16
        assert stored < 0.4 * layer_bytes(plain, i, "bfloat16")


def test_a_quantized_lm_head_stays_stored(checkpoints):
    """GPTQModel's lm_head=True: the head's weight is one more stored weight (the chain above
    computes the reference's tokens with it)."""
    _, copy, _ = checkpoints("gptq-lm-head", "llama")
    head = Head(Checkpoint(copy), dtype=torch.bfloat16)
    assert isinstance(head.lm_weight, StoredWeight) and head.lm_weight.shape == (512, 64)
