"""Frequency and presence penalties and logit bias through a real chain, plain and speculative:
greedy output equals single-process transformers with the same adjustment (OpenAI's formula)
applied to its logits before each choice."""

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardnet.inference.client.client import Client
from shardnet.inference.client.speculative import NGramDrafter
from shardnet.inference.model.local_model import LocalModel
from shardnet.models import default_model_path
from shardnet.testing.helpers import local_chain

PROMPT = "def main(args):\n    "
NEW = 24
PENALTIES = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {11: 3.0, 13: -100.0}}


@pytest.fixture(scope="module")
def reference():
    """Greedy with the adjustment, one full forward pass of transformers per token."""
    path = default_model_path()
    ids = LocalModel(path).encode(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(NEW):
            logits = hf(torch.tensor([ids + out])).logits[0, -1].float()
            for token, bias in PENALTIES["logit_bias"].items():
                logits[token] += bias
            for token, n in Counter(out).items():
                logits[token] -= n * PENALTIES["frequency_penalty"] + PENALTIES["presence_penalty"]
            out.append(int(logits.argmax()))
    return out


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
