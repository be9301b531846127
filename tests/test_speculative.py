"""Speculative decoding through a chain: greedy output identical to plain greedy decoding."""

from contextlib import AsyncExitStack

import pytest
import torch

from shardnet.inference.client import Client, LocalModel
from shardnet.inference.peer import serve_block
from shardnet.inference.speculative import ModelDrafter, NGramDrafter, accept_greedy
from shardnet.models import default_draft_path, default_model_path
from shardnet.transport import open_node

PROMPT = "def __init__(self, name):\n        self.name = name\n        self."
NEW = 40


@pytest.fixture(scope="module")
def reference_ids():
    from transformers import AutoModelForCausalLM

    model = LocalModel(default_model_path())
    ids = model.encode(PROMPT)
    ref = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0, min_new_tokens=NEW)
    return out[0, len(ids):].tolist()


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5], [4, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def test_ngram_drafter_continues_a_repeated_pattern():
    d = NGramDrafter()
    assert d.propose([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert d.propose([1, 2, 3], 2) == []


def test_model_drafter_follows_the_accepted_text():
    d = ModelDrafter(default_draft_path())
    ids = LocalModel(default_model_path()).encode("import os\nimport ")
    first = d.propose(ids, 4)
    again = d.propose(ids, 4)  # same text: same proposals from the rolled-back cache
    assert first == again and len(first) == 4
    longer = d.propose(ids + first[:2], 3)
    assert longer[:2] == first[2:4]  # greedy: the continuation of an accepted prefix is unchanged


@pytest.mark.parametrize("drafter_kind,k", [("ngram", 1), ("ngram", 4), ("model", 1), ("model", 3), ("model", 6)])
async def test_speculative_greedy_equals_plain_greedy(loopback_config, reference_ids, drafter_kind, k):
    path = default_model_path()
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config()))
        cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
        for a, b in ((0, 4), (4, 8)):
            peer = await stack.enter_async_context(open_node(cfg))
            await stack.enter_async_context(serve_block(peer, str(path), a, b))
        node = await stack.enter_async_context(open_node(cfg))
        await node.wait_bootstrapped()
        model = LocalModel(path)
        drafter = NGramDrafter() if drafter_kind == "ngram" else ModelDrafter(default_draft_path(),
                                                                               vocab_size=model.ckpt.config.vocab_size)
        client = Client(node, model)
        got = [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False,
                                                    drafter=drafter, k=k)]
    assert got == reference_ids
    spec = client.last_stats.speculation
    assert spec.traversals < NEW  # fewer chain traversals than tokens
    if drafter_kind == "model":
        assert spec.acceptance > 0.2, spec  # the shipped draft agrees with its target fairly often
