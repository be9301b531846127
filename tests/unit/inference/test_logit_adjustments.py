"""OpenAI's frequency and presence penalties and logit bias, as the sampler applies them."""

import torch

from shardnet.inference.client.sampling import SamplingParams, adjusted


def test_nothing_set_leaves_the_logits_as_they_are():
    logits = torch.randn(2, 10)
    assert adjusted(logits, SamplingParams(), [1, 2], [3]) is logits


def test_each_row_is_penalised_for_what_was_generated_before_it():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = adjusted(torch.zeros(3, 6), p, generated=[2, 2, 4], row_tokens=[4, 5])
    # row 0 follows 2, 2, 4: token 2 twice (2 x 0.5 + 1), token 4 once (0.5 + 1)
    assert out[0].tolist() == [0, 0, -2.0, 0, -1.5, 0]
    # row 1 also follows the 4 row 0 verifies; row 2 the 5 of row 1
    assert out[1].tolist() == [0, 0, -2.0, 0, -2.0, 0]
    assert out[2].tolist() == [0, 0, -2.0, 0, -2.0, -1.5]


def test_the_prompt_is_not_penalised_and_a_bias_applies_to_every_row():
    p = SamplingParams(presence_penalty=2.0, logit_bias=((1, 100.0), (3, -100.0)))
    out = adjusted(torch.zeros(2, 4, dtype=torch.float16), p, generated=[], row_tokens=[1])
    assert out.dtype == torch.float32
    assert out.tolist() == [[0, 100, 0, -100], [0, 98, 0, -100]]


def test_negative_penalties_encourage_repeats():
    out = adjusted(torch.zeros(1, 3), SamplingParams(frequency_penalty=-1.0), [0, 0], [])
    assert out[0, 0] == 2.0


def test_a_receipt_records_only_what_is_set():
    assert SamplingParams().receipt_fields() == {}
    assert SamplingParams(presence_penalty=0.5, logit_bias=((7, 1.0),)).receipt_fields() == \
        {"presence_penalty": 0.5, "logit_bias": [[7, 1.0]]}
