"""The gateway's sans-IO half: request validation, stop sequences while streaming, chat templates."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardnet.gateway import openai_api as oa


def parse(body: dict, chat=False):
    return oa.parse_request(body, chat=chat, render_chat=lambda msgs: "|".join(m["content"] for m in msgs))


def test_defaults_follow_openai():
    r = parse({"model": "m", "prompt": "hi"})
    assert (r.max_tokens, r.temperature, r.top_p, r.stop, r.stream) == (16, 1.0, 1.0, [], False)
    c = parse({"model": "m", "messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 5,
               "stream": True, "stream_options": {"include_usage": True}, "stop": "x"}, chat=True)
    assert (c.prompt, c.max_tokens, c.stream, c.include_usage, c.stop) == ("a", 5, True, True, ["x"])
    assert parse({"model": "m", "prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]  # a batch of one


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "prompt"),
    ({"model": "m", "prompt": "x", "n": 3}, "n"),
    ({"model": "m", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": True}, "top_p"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(oa.ApiError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_bad_messages_are_refused():
    for messages in ([], [{"role": "user"}], ["hi"], [{"role": "user", "content": 3}]):
        with pytest.raises(oa.ApiError):
            parse({"model": "m", "messages": messages}, chat=True)


@pytest.mark.parametrize("body", [b"{", b"[]", b"\xff", b"null", b"3"])
def test_bodies_that_are_not_json_objects(body):
    with pytest.raises(oa.ApiError) as e:
        oa.parse_json(body)
    assert e.value.status == 400


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
                        ["model", "prompt", "messages", "stop", "n", "max_tokens", "temperature", "top_p", "seed",
                         "stream", "stream_options", "role", "content"]), c, max_size=6), max_leaves=12),
       st.booleans())
def test_any_json_is_a_request_or_an_api_error(data, chat):
    body = json.dumps(data, allow_nan=True).encode()
    try:
        parse(oa.parse_json(body), chat=chat)
    except oa.ApiError:
        pass


def stream_through(stops, pieces):
    m = oa.StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    if not m.stopped:
        out.append(m.flush())
    return "".join(out), m.stopped, out


def test_a_stop_sequence_split_across_pieces_is_never_sent():
    text, stopped, out = stream_through(["END"], ["abc E", "N", "D more"])
    assert (text, stopped) == ("abc ", True)
    assert out[0] == "abc "  # the "E" waits until it is clear whether "END" follows


def test_a_false_start_is_released():
    text, stopped, out = stream_through(["END"], ["x EN", "x", " y"])
    assert (text, stopped) == ("x ENx y", False)
    assert out[0] == "x "


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abE N", max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_streaming_equals_cutting_the_whole_text(text, cuts):
    stops = ["EN", "b b"]
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    assert stream_through(stops, pieces)[0] == text[:first]


def test_chat_templates_render_in_a_sandbox():
    tpl = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    assert oa.render_chat_template(tpl, [{"role": "user", "content": "hi"}]) == "<user>hi<a>"
    with pytest.raises(oa.ApiError):  # a template cannot reach Python internals
        oa.render_chat_template("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(oa.ApiError, match="only user"):
        oa.render_chat_template("{{ raise_exception('only user turns') }}", [])


def test_top_p_zero_is_greedy():
    """OpenAI accepts top_p 0..1; 0 keeps only the most likely token: greedy, which the sampler can run."""
    r = parse({"model": "m", "prompt": "x", "temperature": 1.5, "top_p": 0})
    assert (r.temperature, r.top_p) == (0.0, 1.0)
    from shardnet.inference.client.sampling import SamplingParams

    assert SamplingParams(r.temperature, r.top_p).greedy  # what the gateway hands the sampler is valid
    assert parse({"model": "m", "prompt": "x", "top_p": 0.5}).top_p == 0.5


@pytest.mark.parametrize("body, param", [
    (b'{"model": "m", "prompt": "a\\ud800b"}', "prompt"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    (b'{"model": "m", "prompt": "x", "stop": ["\\ud800"]}', "stop"),
    (b'{"model": "m", "prompt": "x", "\\ud800": 1}', None),
])
def test_lone_surrogates_are_refused_naming_the_field(body, param):
    with pytest.raises(oa.ApiError) as e:
        oa.parse_json(body)
    assert e.value.status == 400 and e.value.param == param and "surrogate" in e.value.message


@pytest.mark.parametrize("depth", [oa.MAX_DEPTH + 1, 5000, 100_000])
def test_deep_nesting_is_a_400(depth):
    body = b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(oa.ApiError) as e:
        oa.parse_json(body)
    assert e.value.status == 400 and "nests deeper" in e.value.message


def test_seed_must_fit_64_bits():
    with pytest.raises(oa.ApiError) as e:
        parse({"model": "m", "prompt": "x", "seed": 2**64})
    assert e.value.param == "seed"


def chat(messages, **extra):
    return parse({"model": "m", "messages": messages, **extra}, chat=True)


def test_content_parts_are_text_joined():
    c = chat([{"role": "system", "content": "be brief"},
              {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}])
    assert c.prompt == "be brief|first" + oa.PART_SEPARATOR + "second"


@pytest.mark.parametrize("part, says", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "'image_url'"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "'input_audio'"),
    ({"text": "no type"}, "no type"),
    ({"type": "text", "text": 3}, "string 'text'"),
])
def test_content_parts_that_are_not_text_are_refused(part, says):
    with pytest.raises(oa.ApiError) as e:
        chat([{"role": "user", "content": [{"type": "text", "text": "look:"}, part]}])
    assert e.value.status == 400 and e.value.param == "messages"
    assert "messages[0].content[1]" in e.value.message and says in e.value.message


@pytest.mark.parametrize("content", [[], ["text"], [3], None])
def test_malformed_content_is_refused(content):
    with pytest.raises(oa.ApiError) as e:
        chat([{"role": "user", "content": content}])
    assert e.value.status == 400 and e.value.param == "messages"


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
def test_penalties_are_taken_in_openais_range(name):
    for value in (0, 0.0, None):
        assert getattr(parse({"model": "m", "prompt": "x", name: value}), name) == 0.0
    for value in (0.5, -1, 2):
        assert getattr(parse({"model": "m", "prompt": "x", name: value}), name) == value
        assert getattr(chat([{"role": "user", "content": "x"}], **{name: value}), name) == value
    for value in (3, "high", True):  # outside OpenAI's range, or not a number
        with pytest.raises(oa.ApiError) as e:
            parse({"model": "m", "prompt": "x", name: value})
        assert (e.value.status, e.value.param) == (400, name)


def test_logit_bias_maps_token_ids_to_a_bias():
    r = chat([{"role": "user", "content": "x"}], logit_bias={"50": -100, "7": 2.5})
    assert r.logit_bias == {50: -100.0, 7: 2.5}
    assert parse({"model": "m", "prompt": "x", "logit_bias": {}}).logit_bias == {}  # empty: changes nothing
    bad = [{"x7": 1}, {"-3": 1}, {"7": 101}, {"7": "much"}, {"7": True}, [7], {str(i): 1 for i in range(oa.MAX_LOGIT_BIAS + 1)}]
    for bias in bad:
        with pytest.raises(oa.ApiError) as e:
            parse({"model": "m", "prompt": "x", "logit_bias": bias})
        assert (e.value.status, e.value.param) == (400, "logit_bias"), bias
    with pytest.raises(oa.ApiError, match=r"token 512 is not in the model's vocabulary \(0\.\.511\)"):
        oa.parse_request({"model": "m", "prompt": "x", "logit_bias": {"512": 1}}, chat=False, vocab_size=512)


def test_api_keys_are_checked():
    oa.check_api_key([(b"Authorization", b"Bearer s3cret")], "s3cret")
    oa.check_api_key([(b"authorization", b"bearer  s3cret ")], "s3cret")
    for headers in ([], [(b"authorization", b"Bearer wrong")], [(b"authorization", b"Basic s3cret")],
                    [(b"authorization", b"s3cret")], [(b"authorization", b"Bearer ")], [(b"x-api-key", b"s3cret")]):
        with pytest.raises(oa.ApiError) as e:
            oa.check_api_key(headers, "s3cret")
        assert e.value.status == 401
        err = e.value.body()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "invalid_api_key")
        assert "s3cret" not in err["message"]


def test_chat_template_syntax_is_checked():
    assert oa.check_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None
    assert "line 2" in oa.check_chat_template("ok\n{% for m in messages %}")
    assert oa.check_chat_template("{{ x | no_such_filter }}")


def test_logprobs_are_asked_for_in_each_endpoints_way():
    assert parse({"model": "m", "prompt": "x"}).logprobs is None
    assert parse({"model": "m", "prompt": "x", "logprobs": 0}).logprobs == 0
    assert parse({"model": "m", "prompt": "x", "logprobs": 5}).logprobs == 5
    assert chat([{"role": "user", "content": "x"}], logprobs=True).logprobs == 0
    assert chat([{"role": "user", "content": "x"}], logprobs=True, top_logprobs=20).logprobs == 20
    assert chat([{"role": "user", "content": "x"}], logprobs=False).logprobs is None
    for bad, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                       ({"logprobs": 3}, "logprobs")]:
        with pytest.raises(oa.ApiError) as e:
            chat([{"role": "user", "content": "x"}], **bad)
        assert (e.value.status, e.value.param) == (400, param), bad


def test_logprobs_bodies_have_openais_shapes():
    entries = [oa.LogprobEntry("de", -0.5, [("de", -0.5), ("x", -1.5)], 0),
               oa.LogprobEntry("f", -0.25, [("f", -0.25), ("é", -2.0)], 2)]
    comp = parse({"model": "m", "prompt": "x", "logprobs": 2})
    body = oa.response_body(comp, "cmpl-1", 0, "def", "length", oa.usage(1, 2), entries)["choices"][0]["logprobs"]
    assert body == {"tokens": ["de", "f"], "token_logprobs": [-0.5, -0.25],
                    "top_logprobs": [{"de": -0.5, "x": -1.5}, {"f": -0.25, "é": -2.0}], "text_offset": [0, 2]}
    c = chat([{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2)
    got = oa.chunk_body(c, "chatcmpl-1", 0, text="f", logprobs=entries[1:])["choices"][0]["logprobs"]
    assert got == {"content": [{"token": "f", "logprob": -0.25, "bytes": [102],
                                "top_logprobs": [{"token": "f", "logprob": -0.25, "bytes": [102]},
                                                 {"token": "é", "logprob": -2.0, "bytes": [195, 169]}]}],
                   "refusal": None}
    plain = parse({"model": "m", "prompt": "x"})
    assert oa.response_body(plain, "cmpl-2", 0, "d", "stop", oa.usage(1, 1), entries)["choices"][0]["logprobs"] is None
