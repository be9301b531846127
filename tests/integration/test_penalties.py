"""Frequency and presence penalties and logit bias through a real chain, plain and speculative:
greedy output equals single-process transformers with the same adjustment (OpenAI's formula)
applied to its logits before each choice."""

from collections import Counter

import pytest
import torch

from shardnet.inference.client.client import Client
from shardnet.inference.client.speculative import NGramDrafter
from shardnet.inference.model.local_model import LocalModel
from shardnet.models import default_model_path
from shardnet.testing.helpers import local_chain, transformers_model

PROMPT = "def main(args):\n    "
NEW = 24
#: the adjustment every request here asks for; ``reference`` (tests/conftest.py) applies it too
PENALTIES = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {11: 3.0, 13: -100.0}}


@pytest.mark.parametrize("speculative", [False, True])
async def test_penalised_greedy_equals_transformers(loopback_config, reference, speculative):
    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 4), (4, 8)]) as node:
        client = Client(node, LocalModel(path))
        kw = {"drafter": NGramDrafter(), "k": 4, "depth": 2} if speculative else {}
        got = [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False, **PENALTIES, **kw)]
        plain = [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False)]
    assert got == reference
    assert 13 not in got and got != plain  # the adjustment changed the text
    assert max(Counter(got).values()) <= 3  # repeats are discouraged


async def test_a_bias_for_a_token_outside_the_vocabulary_is_one_clear_error(loopback_config):
    from shardnet.errors import ShardnetError

    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 8)]) as node:
        client = Client(node, LocalModel(path))
        with pytest.raises(ShardnetError, match=r"logit_bias: token 999999 is not in the model's vocabulary"):
            async for _ in client.generate(PROMPT, max_new_tokens=2, logit_bias={999999: 1.0}):
                pass


@pytest.mark.parametrize("speculative", [False, True])
async def test_each_token_carries_its_log_probability(loopback_config, speculative):
    """As transformers gives it for the same text: log-softmax of the logits at each position."""
    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 4), (4, 8)]) as node:
        model = LocalModel(path)
        client = Client(node, model)
        kw = {"drafter": NGramDrafter(), "k": 4, "depth": 2} if speculative else {}
        toks = [t async for t in client.generate(PROMPT, max_new_tokens=12, stop_at_eos=False, logprobs=3, **kw)]
    ids = model.encode(PROMPT)
    out = [t.id for t in toks]
    hf = transformers_model(path)
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float(), dim=-1)
    for i, t in enumerate(toks):
        assert t.logprob == pytest.approx(float(lp[i, t.id]), abs=2e-2)
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0][0] == t.id  # greedy: the most likely
        for alt, value in t.top_logprobs:  # (near-ties may order differently: compare values)
            assert value == pytest.approx(float(lp[i, alt]), abs=2e-2)
        assert t.top_logprobs[-1][1] == pytest.approx(float(torch.topk(lp[i], 3).values[-1]), abs=2e-2)
        assert all(x >= y for (_, x), (_, y) in zip(t.top_logprobs, t.top_logprobs[1:]))
