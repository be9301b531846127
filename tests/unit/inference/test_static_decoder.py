"""The draft's static-KV-cache decoder: same logits as transformers, rollback by position, and (on
CUDA) a captured graph that gives the same tokens as eager execution."""

import pytest
import torch

from shardnet.inference.client.speculative import ModelDrafter
from shardnet.inference.model.random_model import init_random
from shardnet.inference.model.static_decoder import StaticKVDecoder, UnsupportedModel
from shardnet.models import default_draft_path
from shardnet.testing.helpers import transformers_generate, transformers_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (see bench/gpu_check.py)")


def _hf(path):
    return transformers_model(str(path), "float32")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_match_transformers_and_rollback_forgets(tmp_path, family):
    model = _hf(init_random(tmp_path / family, family, layers=2, hidden=64, heads=4, kv_heads=2, vocab=300, seed=5))
    dec = StaticKVDecoder(model, 64)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 300, (24,), generator=gen).tolist()
    other = torch.randint(1, 300, (6,), generator=gen).tolist()
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0]
        ref_other = model(torch.tensor([ids[:10] + other])).logits[0]
        got = [dec.feed(ids[:16])] + [dec.step(torch.tensor(t)).clone() for t in ids[16:]]
        assert dec.length == 24 and int(dec.position) == 24
        dec.rollback(10)  # forget 14 positions, then continue differently
        got_other = dec.feed(other)
    tol = 1e-4  # float32, same weights; only the attention kernel's summation order differs
    assert torch.allclose(got[0], ref[15], atol=tol), (got[0] - ref[15]).abs().max()
    for i, row in enumerate(got[1:]):
        assert torch.allclose(row, ref[16 + i], atol=tol), (i, (row - ref[16 + i]).abs().max())
    assert torch.allclose(got_other, ref_other[-1], atol=tol)


def test_bounds_are_checked():
    dec = StaticKVDecoder(_hf(default_draft_path()), 8)
    dec.feed([1, 2, 3, 4, 5, 6])
    with pytest.raises(OverflowError):
        dec.feed([7, 8, 9])
    assert dec.length == 6  # the refused feed wrote nothing
    with pytest.raises(ValueError):
        dec.rollback(7)
    with pytest.raises(ValueError):
        dec.feed([])
    with pytest.raises(UnsupportedModel, match="CUDA"):
        StaticKVDecoder(_hf(default_draft_path()), 8, cuda_graph=True)


def test_drafter_proposals_equal_transformers_greedy():
    model = _hf(default_draft_path())
    drafter = ModelDrafter(default_draft_path())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 2048, (12,), generator=gen).tolist()
    for step in range(8):
        want = transformers_generate(model, torch.tensor([ids]), 5)[0, len(ids):].tolist()
        assert drafter.propose(ids, 5) == want
        # accept a prefix of the drafts and add a token the draft did not expect, like a verification
        ids = ids + want[:step % 4] + [int(torch.randint(1, 2048, (), generator=gen))]
    assert drafter.propose(list(range(1, 5000)), 4) == []  # longer than its cache: no drafts, no error


@cuda
def test_cuda_graph_gives_the_eager_tokens():
    gen = torch.Generator().manual_seed(2)
    eager = ModelDrafter(default_draft_path(), device="cuda", cuda_graph=False)
    graphed = ModelDrafter(default_draft_path(), device="cuda", cuda_graph=True)
    cpu = ModelDrafter(default_draft_path())
    assert graphed.graphed and not eager.graphed
    ids = torch.randint(1, 2048, (20,), generator=gen).tolist()
    for step in range(30):
        a, b, c = eager.propose(ids, 6), graphed.propose(ids, 6), cpu.propose(ids, 6)
        assert a == b, (step, a, b)
        assert a == c, (step, a, c)
        ids = ids + a[:step % 5] + [int(torch.randint(1, 2048, (), generator=gen))]  # roll back under the graph
