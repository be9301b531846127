"""bench/gateway_load.py's TieCheck on the case CI met: 64 requests at once through peers batching
in float16, one text swapped two tokens whose float16 logits tie and went on from the other."""

from bench.gateway_load import TieCheck

PROMPT = "with open(path) as f:\n"
ALONE = "\ndef _get_remove_name(path):"  # what the prompt gets alone (every step computed alone)
SERVED = "\ndef _get_name(path, name):\n   "  # what one of 64 batched requests got (CI, stop 49)


def test_a_swap_at_a_float16_tie_is_a_near_tie_and_other_texts_are_wrong():
    ties = TieCheck()
    assert ties.consistent(PROMPT, ALONE)
    assert ties.consistent(PROMPT, SERVED)  # token 5: its logit equals the best in float16
    assert not ties.consistent(PROMPT, "\ndef _get_name(path):")  # a token far below its position's best
    assert not ties.consistent(PROMPT, "\n\n\nimport os\nimport os\nimport os\n")  # another prompt's text
