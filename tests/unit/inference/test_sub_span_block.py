"""A block running part of its layers (a sub-span session, issue 39) computes exactly what a
block of just those layers computes: a prompt, decode steps and a tree step, with a cache of
exactly those layers, for families with sliding windows, sinks, MLA and experts."""

import pytest
import torch

from shardnet.inference.model.block import Block
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.random_model import init_random


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sub-span")
    return {fam: Checkpoint(init_random(root / fam, fam, layers=5, hidden=64, heads=4, kv_heads=2, vocab=128,
                                        seed=5, sliding_window=4 if fam == "mistral" else None))
            for fam in ("llama", "mistral", "gemma3_text", "deepseek_v3")}


def _steps(block: Block, layers, span, steps) -> list[torch.Tensor]:
    cache = block.new_cache(64, layers)
    out, pos = [], 0
    for h, tree in steps:
        out.append(block.forward(h, cache, pos, tree=tree, layers=layers))
        pos += h.shape[1] if tree is None else 0
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text", "deepseek_v3"])
@pytest.mark.parametrize("span", [(1, 3), (0, 2), (3, 5), (2, 3)])
@torch.inference_mode()
def test_a_sub_span_computes_what_a_block_of_its_layers_computes(models, family, span):
    ckpt = models[family]
    whole, alone = Block(ckpt, 0, 5), Block(ckpt, *span)
    g = torch.Generator().manual_seed(1)
    hidden = whole.config.hidden_size
    steps = [(torch.randn(1, 7, hidden, generator=g), None)] + [(torch.randn(1, 1, hidden, generator=g), None)
                                                               for _ in range(3)]
    if whole.takes_trees:
        steps.append((torch.randn(1, 3, hidden, generator=g), [-1, 0, 0]))
    got = _steps(whole, span, span, steps)
    want = _steps(alone, None, span, steps)
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)
    assert whole.kv_bytes_per_token(span) == alone.kv_bytes_per_token()
    # the block's own whole-span path is unchanged afterwards (the modules address it again)
    assert torch.equal(_steps(whole, None, None, steps[:2])[1], _steps(Block(ckpt, 0, 5), None, None, steps[:2])[1])


def test_layers_outside_the_block_and_batched_sub_spans_are_refused(models):
    block = Block(models["llama"], 1, 4)
    with pytest.raises(ValueError, match="layers 0:2 are not within this block's 1:4"):
        block.new_cache(8, (0, 2))
    with pytest.raises(ValueError, match="a cache of 3 layers for a pass over 1"):
        block.forward(torch.zeros(1, 1, block.config.hidden_size), block.new_cache(8), 0, layers=(2, 3))
    sub = block.new_cache(8, (2, 3))
    with pytest.raises(ValueError, match="run alone"):
        block.forward_batch([(torch.zeros(1, 1, block.config.hidden_size), sub),
                             (torch.zeros(1, 1, block.config.hidden_size), block.new_cache(8))])
