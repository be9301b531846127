"""A session's KV cache on a block is written where it lies (issue 35): allocated once at the
session's length, extended in place by every step (alone or batched), rolled back by its length,
freed at once; a family whose attention transforms its cache (MLA's latent) batches row by row."""

import pytest
import torch

from shardnet.inference.model.block import Block, Head
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.kv_cache import SlabLayer
from shardnet.inference.model.random_model import init_random


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = init_random(tmp_path_factory.mktemp("llama") / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2,
                       vocab=300, seed=3)
    ckpt = Checkpoint(path)
    return Block(ckpt, 0, 2), Head(ckpt)


def storage(cache):
    return [(layer._k.data_ptr(), layer._v.data_ptr()) for layer in cache.layers]


def test_a_session_cache_holds_exactly_its_length_and_is_written_in_place(llama):
    block, head = llama
    cache, other = block.new_cache(40), block.new_cache(40)
    assert cache.nbytes == 40 * block.kv_bytes_per_token()
    where = storage(cache)
    block.forward(head.embed(torch.tensor([[5, 6, 7, 8]])), cache, 0)
    before = [layer.keys.clone() for layer in cache.layers]
    block.forward_batch([(head.embed(torch.tensor([[9]])), cache), (head.embed(torch.tensor([[1, 2]])), other)])
    block.forward(head.embed(torch.tensor([[10, 11]])), cache, 5)
    assert storage(cache) == where  # never reallocated: steps write into the same tensors
    for layer, old in zip(cache.layers, before):
        assert torch.equal(layer.keys[:, :, :4], old)  # the past is never rewritten
    assert cache.get_seq_length() == 7 and other.get_seq_length() == 2


def test_rollback_moves_the_length_and_the_next_step_overwrites(llama):
    block, head = llama
    cache, fresh = block.new_cache(16), block.new_cache(16)
    block.forward(head.embed(torch.tensor([[5, 6, 7, 8]])), cache, 0)
    cache.crop(-2)
    out = block.forward(head.embed(torch.tensor([[3, 4]])), cache, 2)
    expected = block.forward(head.embed(torch.tensor([[5, 6, 3, 4]])), fresh, 0)
    torch.testing.assert_close(out, expected[:, 2:], rtol=1e-4, atol=1e-4)  # (chunked differently)


def test_a_step_past_the_sessions_length_is_refused_and_release_frees(llama):
    block, head = llama
    cache = block.new_cache(3)
    block.forward(head.embed(torch.tensor([[1, 2]])), cache, 0)
    with pytest.raises(ValueError, match="exceed this KV cache's 3"):
        block.forward(head.embed(torch.tensor([[3, 4]])), cache, 2)
    cache.release()
    assert cache.nbytes == 0


def test_a_cache_without_a_length_grows_and_keeps_its_past(llama):
    block, head = llama
    grown, sized = block.new_cache(), block.new_cache(600)
    ids = torch.arange(1, 300)[None]
    for cache in (grown, sized):
        block.forward(head.embed(ids[:, :200]), cache, 0)
        block.forward(head.embed(ids[:, 200:]), cache, 200)
    assert grown.layers[0].capacity >= 299
    for a, b in zip(grown.layers, sized.layers):
        assert torch.equal(a.keys, b.keys)


def test_mla_batches_its_attention_row_by_row(tmp_path):
    path = init_random(tmp_path / "dsv3", "deepseek_v3", layers=2, hidden=64, heads=4, kv_heads=4, vocab=300, seed=4,
                       experts=4, active_experts=2)
    ckpt = Checkpoint(path)
    block, head = Block(ckpt, 0, 2), Head(ckpt)
    caches = [block.new_cache(16) for _ in range(3)]
    alone = [block.new_cache(16) for _ in range(3)]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    together = block.forward_batch([(head.embed(torch.tensor([p])), c) for p, c in zip(prompts, caches)])
    assert block._rowwise_layers == {0, 1}  # its attention expands the latent cache it reads
    for p, c, out in zip(prompts, alone, together):
        torch.testing.assert_close(out, block.forward(head.embed(torch.tensor([p])), c, 0), rtol=1e-4, atol=1e-4)
    assert all(isinstance(layer, SlabLayer) for layer in caches[0].layers)
