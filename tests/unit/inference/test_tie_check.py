"""bench/gateway_load.py's TieCheck on the case CI met: 64 requests at once through peers batching
in float16, one text swapped two tokens whose float16 logits tie and went on from the other."""

from bench.gateway_load import MAX_TOKENS, PROMPTS, TieCheck

PROMPT = "with open(path) as f:\n"
ALONE = "\ndef _get_remove_name(path):"  # what the prompt gets alone (every step computed alone)
SERVED = "\ndef _get_name(path, name):\n   "  # what one of 64 batched requests got (CI, stop 49)


def test_a_swap_at_a_float16_tie_is_a_near_tie_and_other_texts_are_wrong():
    ties = TieCheck()
    assert ties.consistent(PROMPT, ALONE, "length", MAX_TOKENS)
    assert ties.consistent(PROMPT, SERVED, "length", MAX_TOKENS)  # token 5: its logit equals the best in float16
    assert not ties.consistent(PROMPT, "\ndef _get_name(path):", "length", MAX_TOKENS)  # a token far below
    assert not ties.consistent(PROMPT, "\n\n\nimport os\nimport os\nimport os\n", "length", MAX_TOKENS)
    # a text cut short is wrong, whether it says it ran out of tokens or stopped (no end token is near the best)
    assert not ties.consistent(PROMPT, SERVED[:-4], "length", MAX_TOKENS)
    assert not ties.consistent(PROMPT, SERVED[:-4], "stop", MAX_TOKENS)


def test_every_load_prompt_s_own_text_passes_though_re_encoding_would_not_give_it_back():
    """Byte-level BPE merges a prompt's last characters with the first of the text ("range(" +
    "self", a trailing space + a word): re-encoding prompt + text does not give the prompt's
    tokens back for some of the load test's prompts; the walk goes by text, so each prompt's
    own greedy text passes."""
    ties = TieCheck()
    merged = 0
    for prompt in PROMPTS:
        ids, out = ties.model.encode(prompt), []
        for _ in range(MAX_TOKENS):  # the greedy text alone, computed here
            out.append(ties._within(ties._next_logits(ids + out))[0])
        text = ties.model.decode(out)
        merged += ties.model.encode(prompt + text)[:len(ids)] != ids
        assert ties.consistent(prompt, text, "length", MAX_TOKENS), prompt
    assert merged >= 1  # (the case the walk is for is among them)
