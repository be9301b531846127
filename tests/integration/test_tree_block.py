"""A block runs a tree of drafts in one pass (``Block.forward(..., tree=parents)``): every token's
output is what single-process transformers gives for the text from the root to it, and
``SessionKv.keep`` leaves the cache holding the accepted path, from which decoding goes on as
if only that path had been sent. The building block of tree speculation (issue 38); the
protocol and the client do not send trees yet."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardnet.inference.model.block import Block, Head, tree_shape
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.models import default_model_path

PREFIX = [746, 576, 1004, 40, 496, 480]
# a tree of 7 drafts: two branches under the first, one of them forking again
PARENTS = [-1, 0, 0, 1, 2, 2, 5]
TOKENS = [35, 301, 12, 77, 501, 9, 64]


def path_to(i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = PARENTS[i]
    return out[::-1]


@pytest.fixture(scope="module")
def parts():
    ckpt = Checkpoint(default_model_path())
    head = Head(ckpt, dtype=torch.float32)
    first, second = Block(ckpt, 0, 4, dtype=torch.float32), Block(ckpt, 4, 8, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32).eval()
    return head, [first, second], hf


def run_tree(head, blocks, caches):
    """The prefix, then the tree, through both blocks: logits per tree token."""
    h = head.embed(torch.tensor([PREFIX]))
    for b, c in zip(blocks, caches):
        h = b.forward(h, c, 0)
    h = head.embed(torch.tensor([TOKENS]))
    for b, c in zip(blocks, caches):
        h = b.forward(h, c, len(PREFIX), tree=PARENTS)
    return head.logits(h)[0]


def test_every_tree_token_gets_what_its_path_would(parts):
    head, blocks, hf = parts
    caches = [b.new_cache(64) for b in blocks]
    logits = run_tree(head, blocks, caches)
    for i in range(len(PARENTS)):
        ids = torch.tensor([PREFIX + [TOKENS[j] for j in path_to(i)]])
        with torch.no_grad():
            want = hf(ids).logits[0, -1].float()
        assert torch.allclose(logits[i], want, atol=1e-4), (i, float((logits[i] - want).abs().max()))
        assert int(logits[i].argmax()) == int(want.argmax())
    assert all(c.get_seq_length() == len(PREFIX) + len(PARENTS) for c in caches)


def test_keep_leaves_the_accepted_path_and_decoding_goes_on_from_it(parts):
    head, blocks, hf = parts
    caches = [b.new_cache(64) for b in blocks]
    run_tree(head, blocks, caches)
    accepted = path_to(6)  # 0 -> 2 -> 5 -> 6
    for c in caches:
        c.keep(len(PREFIX), accepted)
        assert c.get_seq_length() == len(PREFIX) + len(accepted)
    nxt = 88
    h = head.embed(torch.tensor([[nxt]]))
    for b, c in zip(blocks, caches):
        h = b.forward(h, c, len(PREFIX) + len(accepted))
    ids = torch.tensor([PREFIX + [TOKENS[j] for j in accepted] + [nxt]])
    with torch.no_grad():
        want = hf(ids).logits[0, -1].float()
    assert torch.allclose(head.logits(h)[0, -1], want, atol=1e-4)


def test_bad_trees_are_refused(parts):
    _, blocks, _ = parts
    with pytest.raises(ValueError, match="not an earlier token"):
        tree_shape([-1, 1], 2)
    with pytest.raises(ValueError, match="2 parents for 3 tokens"):
        tree_shape([-1, 0], 3)
    c = blocks[0].new_cache(64)
    with pytest.raises(ValueError, match="must increase"):
        c.keep(0, [2, 1])
    sliding = Block(Checkpoint(default_model_path()), 0, 1, dtype=torch.float32)
    cache = sliding.new_cache(8)  # (the cache's layout is probed with a plain pass first)
    sliding.layer_types = ["sliding_attention"]
    with pytest.raises(ValueError, match="full attention"):
        sliding.forward(torch.zeros(1, 2, sliding.config.hidden_size), cache, 0, tree=[-1, 0])
    depths, ancestors = tree_shape(PARENTS, len(PARENTS))
    assert depths.tolist() == [0, 1, 1, 2, 2, 2, 3] and ancestors[6].nonzero().flatten().tolist() == [0, 2, 5, 6]
