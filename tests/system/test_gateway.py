"""The OpenAI-compatible gateway (`shardnet serve`) as a real process in front of a real swarm,
driven by the official `openai` client and by plain HTTP."""

import concurrent.futures
import json
import re
import socket
import time
from functools import partial

import openai
import pytest

from shardnet.inference.model.local_model import LocalModel
from shardnet.models import default_model_path
from shardnet.testing.helpers import http_request, openai_client, transformers_greedy, wait_healthy
from shardnet.testing.localswarm import LocalSwarm

pytestmark = pytest.mark.slow

PROMPT = "def main(args):\n    "
MAX = 12
GATEWAY_LOG = []  # the module gateway's log file


def start_gateway(swarm: LocalSwarm, *extra: str) -> str:
    url, p = swarm.start_gateway(*extra)
    GATEWAY_LOG.append(p.log_path)
    return url


GATEWAY = {}  # the module gateway's swarm and identity file


@pytest.fixture(scope="module")
def gateway():
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        swarm.join_spans([(0, 4), (4, 8)], "--threads", "1")
        identity = swarm.workdir / "gateway.key"
        GATEWAY.update(swarm=swarm, identity=identity)
        url = start_gateway(swarm, "--identity", str(identity))
        wait_healthy(url)
        yield url


@pytest.fixture(scope="module")
def expected():
    """What plain transformers generates greedily, cut at the end-of-text token, as text."""
    model = LocalModel(default_model_path())
    ids = transformers_greedy(default_model_path(), PROMPT, MAX)
    cut = next((i for i, t in enumerate(ids) if t in model.eos_ids), len(ids))
    return model.decode(ids[:cut]), len(model.encode(PROMPT)), cut


api = partial(openai_client, timeout=120)  # the official client for a gateway URL


def test_a_completion_equals_transformers_with_usage(gateway, expected):
    text, prompt_tokens, n = expected
    r = api(gateway).completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=MAX, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny-llama"
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == ("length" if n == MAX else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, n)
    assert r.usage.total_tokens == prompt_tokens + n


def test_a_streamed_chat_completion(gateway):
    client = api(gateway)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content and whole.choices[0].message.role == "assistant"
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 10  # the template's framing counts


def test_stop_sequences_cut_the_text_and_seeded_sampling_repeats(gateway, expected):
    text = expected[0]
    client = api(gateway)
    stop = text[3:6]
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=MAX, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=MAX, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text
    a, b = (client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9,
                                      seed=5).choices[0].text for _ in range(2))
    assert a == b


def test_penalties_bias_and_logprobs_are_applied(gateway, expected):
    text, prompt_tokens, n = expected
    api_ = api(gateway)
    # a bias of 100 makes greedy choose that token every time; a penalty changes the text
    forced = api_.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0,
                                     logit_bias={"7": 100})
    assert forced.choices[0].text == LocalModel(default_model_path()).decode([7] * 4)
    penalised = api_.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=MAX, temperature=0,
                                        frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].text != text
    # logprobs: one per token, the chosen token the most likely (greedy), in each endpoint's shape
    r = api_.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=MAX, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and "".join(lp.tokens) == text
    assert len(lp.token_logprobs) == r.usage.completion_tokens and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(x) for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = api_.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    stream = api_.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, stream=True)
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]


def test_concurrent_requests_are_all_served(gateway, expected):
    client = api(gateway)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=MAX, temperature=0).choices[0].text, range(4)))
    assert got == [expected[0]] * 4


def test_bad_requests_get_openai_errors(gateway):
    client = api(gateway)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=10**7)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-llama", prompt="x", temperature=7)


@pytest.mark.parametrize("body, status", [
    (b"{not json", 400), (b"[1, 2]", 400), (b"", 400), (b'{"model": "tiny-llama"}', 400),
    (b'{"model": "tiny-llama", "prompt": "x", "max_tokens": "many"}', 400),
    (b'{"model": "tiny-llama", "prompt": [99999999]}', 400),
    (b"x" * ((1 << 20) + 1), 413),
    (b'{"model": "tiny-llama", "prompt": "a\\ud800b"}', 400),  # a lone surrogate: no tokenizer encodes it
    (b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\udc00"}]}', 400),
    (b'{"model": "tiny-llama", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
])
def test_malformed_bodies_get_error_json(gateway, body, status):
    got, data = http_request(gateway, "POST", "/v1/completions", body, {"content-type": "application/json"})
    assert got == status
    err = json.loads(data)["error"]
    assert err["message"] and err["type"] == "invalid_request_error"


def test_health_models_swarm_and_unknown_paths(gateway):
    health = wait_healthy(gateway)  # waits for coverage rather than racing it
    assert health["status"] == "ok" and health["missing_layers"] == [] and health["num_layers"] == 8
    status, data = http_request(gateway, "GET", "/v1/models")
    assert [m["id"] for m in json.loads(data)["data"]] == ["tiny-llama"]
    assert [m.id for m in api(gateway).models.list()] == ["tiny-llama"]
    deadline = time.monotonic() + 60
    while True:  # and what the swarm serves, from the peers' model cards (published once they serve)
        swarm_models = json.loads(http_request(gateway, "GET", "/v1/models")[1])["swarm"]
        if swarm_models and swarm_models[0]["covered"] == [[0, 8]]:
            break
        assert time.monotonic() < deadline, swarm_models
        time.sleep(1)
    assert swarm_models[0]["names"][0] == "tiny-llama" and swarm_models[0]["family"] == "llama"
    assert swarm_models[0]["model_id"] == json.loads(data)["data"][0]["shardnet"]["model_id"]
    deadline = time.monotonic() + 60
    while True:  # /v1/swarm looks the claims up afresh (and pings every peer): wait for both answers
        status, data = http_request(gateway, "GET", "/v1/swarm")
        swarm = json.loads(data)
        if status == 200 and swarm["missing_layers"] == [] and len(swarm["peers"]) == 2:
            break
        assert time.monotonic() < deadline, swarm
        time.sleep(0.5)
    assert all(c["peers"] == 1 for c in swarm["coverage"])
    assert http_request(gateway, "GET", "/v2/nothing")[0] == 404
    assert http_request(gateway, "GET", "/v1/completions")[0] == 405
    # probes are not requests; completions are
    assert wait_healthy(gateway)["requests"] == health["requests"]
    api(gateway).completions.create(model="tiny-llama", prompt="x", max_tokens=1)
    assert wait_healthy(gateway)["requests"] == health["requests"] + 1


def test_serve_uses_the_identity_it_is_given(gateway):
    from shardnet.testing.helpers import shardnet

    r = shardnet("id", "--identity", str(GATEWAY["identity"]))
    assert "(existing)" in r.stdout, r.stdout  # serve created it
    assert wait_healthy(gateway)["peer_id"] == re.search(r"peer id:\s+(\S+)", r.stdout).group(1)


def test_an_http_port_in_use_is_one_error_line(gateway):
    from shardnet.testing.helpers import assert_one_line_failure, shardnet

    port = gateway.rsplit(":", 1)[1]  # held by the module's gateway
    r = shardnet("serve", "--bootstrap", GATEWAY["swarm"].bootstrap_addr, "--port", port, timeout=120)
    assert_one_line_failure(r, rf"HTTP 127\.0\.0\.1:{port}: port {port} is already in use by another process")
    assert "unexpected" not in r.stderr


def test_top_p_zero_is_greedy(gateway, expected):
    r = api(gateway).completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=MAX, temperature=1.0, top_p=0,
                                        seed=3)
    assert r.choices[0].text == expected[0]


def test_a_swarm_that_cannot_cover_the_model_is_a_503():
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        swarm.join_spans([(0, 4)], "--threads", "1")
        url = start_gateway(swarm, "--route-timeout", "2")
        with pytest.raises(openai.InternalServerError) as e:
            api(url).completions.create(model="tiny-llama", prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "no_route"
        assert "layers 4-7" in e.value.body["message"]
        status, data = http_request(url, "GET", "/health")  # health says what completions see
        health = json.loads(data)
        assert status == 503 and health["status"] == "unavailable", health
        assert health["missing_layers"] == [4, 5, 6, 7] and "layers 4-7" in health["reason"]


def test_a_streaming_client_that_goes_away_stops_its_generation(gateway):
    host, port = gateway.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 400, "stream": True,
                       "temperature": 0}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)
        assert b"200" in got.split(b"\r\n")[0]
    log = GATEWAY_LOG[0]
    deadline = time.monotonic() + 30
    while "generation cancelled" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)
    status, _ = http_request(gateway, "GET", "/health")  # and it goes on serving
    assert status == 200


def test_a_waiting_client_that_goes_away_stops_its_generation(gateway):
    """Not streaming: the client waits for the whole answer, and gives up (closes) before it."""
    log = GATEWAY_LOG[0]
    started, cancelled = (log.read_text().count(s) for s in ("generating up to 1000 tokens", "went away"))
    host, port = gateway.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while log.read_text().count("generating up to 1000 tokens") == started:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
    deadline = time.monotonic() + 30
    while log.read_text().count("went away") == cancelled:
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)
    assert re.search(r"cmpl-\w+: \d+ prompt tokens, cancelled: the client went away", log.read_text())
    assert wait_healthy(gateway)["status"] == "ok"  # and it goes on serving


def test_an_api_key_a_chat_template_and_the_probes(gateway, tmp_path):
    """A second gateway on the module's swarm, with a key and its own chat template: the official
    client gets a 401 without the key and answers with it; /livez and /readyz need no key."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    url = start_gateway(GATEWAY["swarm"], "--api-key", "sk-system-test", "--chat-template", str(template))
    assert http_request(url, "GET", "/livez")[0] == 200
    deadline = time.monotonic() + 90
    while True:
        status, data = http_request(url, "GET", "/readyz")
        ready = json.loads(data)
        if status == 200:
            break
        assert status == 503 and ready["ready"] is False and ready["reason"], ready
        assert time.monotonic() < deadline, ready
        time.sleep(0.5)
    assert ready["ready"] is True and ready["missing_layers"] == []
    with pytest.raises(openai.AuthenticationError) as e:
        api(url).models.list()  # api() sends the key "unused"
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    status, data = http_request(url, "GET", "/v1/models")
    assert status == 401 and json.loads(data)["error"]["type"] == "invalid_request_error"
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-system-test", max_retries=0, timeout=120)
    parts = [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "    return"}]
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": parts}],
                                       max_tokens=4, temperature=0)
    rendered = "user: def add(a, b):\n    return\nassistant:"  # the given template, parts joined
    assert r.usage.prompt_tokens == len(LocalModel(default_model_path()).encode(rendered))
    with pytest.raises(openai.BadRequestError) as e:  # (a token outside the vocabulary)
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, logit_bias={"99999999": 1})
    assert e.value.body["param"] == "logit_bias"


def test_a_gateway_that_speculates_answers_the_same(gateway, expected):
    """`serve --speculate auto --share-outputs` (per request: suffix matching, over the request's
    text and the gateway's earlier outputs, or plain decoding, chosen as it goes) gives the greedy
    text plain decoding gives, streamed or not (the second request repeats the first: drafted
    from its output)."""
    url = start_gateway(GATEWAY["swarm"], "--speculate", "auto", "--share-outputs")
    wait_healthy(url)
    client = api(url)
    text, _, _ = expected
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=MAX, temperature=0)
    assert r.choices[0].text == text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=MAX, temperature=0, stream=True))
    assert streamed == text
