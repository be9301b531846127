"""The gateway's ASGI app in-process: a real node (no peers), a real Client over the shipped
tiny model, requests driven straight through the ASGI interface. Covers what needs no swarm:
the API key, the probes, content parts and chat templates up to the routing step."""

import json

import pytest
import trio
from click.testing import CliRunner

from shardnet.gateway.server import Gateway
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.models import default_model_path
from shardnet.protocols import block_claim as bc
from shardnet.transport import NodeConfig, open_node

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def model():
    return LocalModel(default_model_path(), dtype="float32")


async def call(app, method: str, path: str, body: dict | bytes = b"", headers=()) -> tuple[int, dict, dict]:
    """One HTTP request through the ASGI app: (status, JSON body, headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await trio.sleep_forever()  # the client stays connected

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers = dict(start["headers"])
    if not headers[b"content-type"].startswith(b"application/json"):
        return start["status"], payload.decode(), headers
    return start["status"], json.loads(payload), headers


def gateway(node, model, **kw) -> Gateway:
    return Gateway(Client(node, model, route_timeout=0.5), "tiny-llama", route_timeout=0.5, **kw)


COMPLETION = {"model": "tiny-llama", "prompt": "x", "max_tokens": 1}


async def test_an_api_key_guards_v1_and_leaves_the_probes_open(model):
    async with open_node(NodeConfig(dht_mode="client")) as node:
        app = gateway(node, model, api_key=KEY)
        for method, path, body in [("GET", "/v1/models", b""), ("POST", "/v1/completions", COMPLETION),
                                   ("GET", "/v1/swarm", b""), ("GET", "/v1/nothing", b"")]:
            for headers in ([], [("Authorization", "Bearer wrong")], [("Authorization", KEY)]):
                status, got, hdrs = await call(app, method, path, body, headers)
                assert status == 401, (path, headers)
                assert got["error"]["code"] == "invalid_api_key" and got["error"]["param"] is None
                assert got["error"]["type"] == "invalid_request_error" and hdrs[b"www-authenticate"] == b"Bearer"
        status, got, _ = await call(app, "GET", "/v1/models", headers=[("Authorization", f"Bearer {KEY}")])
        assert status == 200 and got["data"][0]["id"] == "tiny-llama"
        # with the key a completion gets as far as routing (no peers here: 503 no_route)
        status, got, _ = await call(app, "POST", "/v1/completions", COMPLETION, [("Authorization", f"Bearer {KEY}")])
        assert (status, got["error"]["code"]) == (503, "no_route")
        assert app.requests == 1  # refused requests never reached generation
        # the probes answer without the key, as without one: alive, and not ready (no peers here)
        assert (await call(app, "GET", "/livez"))[:2] == (200, {"status": "alive"})
        for path in ("/health", "/readyz"):
            status, got, _ = await call(app, "GET", path)
            assert (status, got["status"], got["missing_layers"]) == (503, "unavailable", list(range(8))), path


async def test_without_a_key_nothing_is_asked(model):
    async with open_node(NodeConfig(dht_mode="client")) as node:
        app = gateway(node, model)
        for headers in ([], [("Authorization", "Bearer anything")]):  # a key sent anyway is not checked
            status, got, hdrs = await call(app, "GET", "/v1/models", headers=headers)
            assert status == 200 and got["data"][0]["id"] == "tiny-llama", got
            assert b"www-authenticate" not in hdrs
        # a completion gets as far as routing (no peers here: 503 no_route), not refused for a key
        status, got, _ = await call(app, "POST", "/v1/completions", COMPLETION)
        assert (status, got["error"]["code"]) == (503, "no_route")
        assert app.requests == 1


async def test_a_gateways_claims_view_follows_every_layer_range(model):
    """A gateway routes through every range: its view hears each range's news (a Python client's
    follows none and looks up)."""
    async with open_node(NodeConfig(dht_mode="client")) as node:
        app = gateway(node, model)
        ranges = bc.layer_ranges(model.ckpt.num_layers)
        assert app.client.planner.view.following == frozenset(range(len(ranges)))


async def test_livez_and_readyz(model):
    """Alive while it serves HTTP; ready only with a full chain in view (none here: 503 and why)."""
    async with open_node(NodeConfig(dht_mode="client")) as node:
        app = gateway(node, model)
        assert (await call(app, "GET", "/livez"))[:2] == (200, {"status": "alive"})
        status, got, _ = await call(app, "GET", "/readyz")
        assert status == 503 and got["ready"] is False and got["status"] == "unavailable"
        assert got["missing_layers"] == list(range(8)) and "no live peer serves layers 0-7" in got["reason"]
        health_status, health, _ = await call(app, "GET", "/health")
        assert health_status == status and health["missing_layers"] == got["missing_layers"]
        assert (await call(app, "POST", "/livez"))[0] == 405
        assert app.requests == 0  # probes are not requests


async def test_content_parts_and_a_given_chat_template(model):
    async with open_node(NodeConfig(dht_mode="client")) as node:
        app = gateway(node, model, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}>")
        rendered = []
        real = app._render_chat
        app._render_chat = lambda messages: rendered.append(real(messages)) or rendered[-1]
        body = {"model": "tiny-llama", "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
        status, got, _ = await call(app, "POST", "/v1/chat/completions", body)
        assert (status, got["error"]["code"]) == (503, "no_route")  # accepted, then no peers
        assert rendered == ["[a\nb]>"]  # the given template, not the model's
        body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}})
        status, got, _ = await call(app, "POST", "/v1/chat/completions", body)
        assert (status, got["error"]["param"]) == (400, "messages") and "image_url" in got["error"]["message"]
        status, got, _ = await call(app, "POST", "/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}})
        assert (status, got["error"]["param"]) == (400, "logit_bias")


@pytest.mark.parametrize("content, says", [
    (None, "cannot read it"),
    ("", "the file is empty"),
    ("{% for m in messages %}{{ m }}", "not a valid Jinja template (line 1"),
])
def test_a_bad_chat_template_file_is_one_error_line(tmp_path, content, says):
    from shardnet.cli.serve import serve

    path = tmp_path / "template.jinja"
    if content is not None:
        path.write_text(content)
    r = CliRunner().invoke(serve, ["--chat-template", str(path)])
    assert r.exit_code != 0
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: chat template {path}: ") and says in lines[0], r.output


def test_an_empty_api_key_is_refused():
    from shardnet.cli.serve import serve

    r = CliRunner().invoke(serve, ["--api-key", " "])
    assert r.exit_code != 0 and r.output.strip() == "error: --api-key is empty (leave it out to serve without a key)"
    r = CliRunner().invoke(serve, ["--share-outputs"])
    assert r.exit_code != 0 and r.output.strip() == ("error: --share-outputs is for suffix drafting: add "
                                                     "--speculate auto or --speculate suffix")


async def test_metrics_are_served_in_prometheus_format_without_the_api_key(model):
    from prometheus_client.parser import text_string_to_metric_families

    async with open_node(NodeConfig(dht_mode="client")) as node:
        app = gateway(node, model, api_key=KEY)
        status, text, headers = await call(app, "GET", "/metrics")
        assert status == 200 and headers[b"content-type"].startswith(b"text/plain; version=")
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["shardnet_node_info"].samples[0].labels["peer_id"] == str(node.peer_id)
        assert families["shardnet_client_sessions"].samples[0].value == 0  # this gateway's client, from the start
        status, got, _ = await call(app, "POST", "/metrics")
        assert status == 405


async def test_only_a_request_that_starts_alone_speculates(model):
    """`serve --speculate auto` drafts for a request that starts while no other is generating;
    with others generating the peers are busy, and it decodes plainly."""
    from types import SimpleNamespace

    from shardnet.inference.client.auto_drafter import AutoDrafter

    async with open_node(NodeConfig(dht_mode="client")) as node:
        app = gateway(node, model, speculate="auto")
        drafters = []
        app.client.generate = lambda ids, **kw: drafters.append(kw["drafter"])
        req = SimpleNamespace(temperature=0.0, top_p=1.0, seed=None, frequency_penalty=0.0, presence_penalty=0.0,
                              logit_bias=None, logprobs=None)
        for generating in (1, 3):  # (the request itself counts)
            app.generating = generating
            app._tokens(req, [1, 2], 4, route=None)
        assert isinstance(drafters[0], AutoDrafter) and drafters[1] is None
        assert gateway(node, model).speculate == "none"  # the default


async def test_shared_outputs_feed_every_requests_suffix_drafter(model):
    """`serve --share-outputs`: each request's suffix drafter also matches the gateway's recent
    outputs (not a seeded sampled request's), and a request's output joins them when it ends
    (cut short too); refused without suffix drafting."""
    from types import SimpleNamespace

    from shardnet.inference.client.decode import Token

    async with open_node(NodeConfig(dht_mode="client")) as node:
        app = gateway(node, model, speculate="auto", share_outputs=True)
        drafters = []

        async def generate(ids, **kw):
            drafters.append(kw["drafter"])
            for t in (7, 8, 9):
                yield Token(t, "x")

        app.client.generate = generate
        req = SimpleNamespace(temperature=0.0, top_p=1.0, seed=None, frequency_penalty=0.0, presence_penalty=0.0,
                              logit_bias=None, logprobs=None)
        app.generating = 1
        assert [t.id async for t in app._tokens(req, [1, 2], 3, route=None)] == [7, 8, 9]
        suffix = drafters[0].candidates["suffix"]
        assert suffix.cache is app.outputs and app.outputs.tokens == 3
        assert suffix.propose([5, 7, 8], 1) == [9]  # drafted from the earlier output
        gen = app._tokens(req, [1, 2], 3, route=None)
        assert (await gen.__anext__()).id == 7
        await gen.aclose()  # a request cut short (a stop sequence, a disconnect)
        assert app.outputs.tokens == 4 and app.outputs.tries[-1].tokens == 1
        seeded = SimpleNamespace(**{**vars(req), "temperature": 0.8, "seed": 3})  # (its text must not depend on them)
        [t async for t in app._tokens(seeded, [1, 2], 3, route=None)]
        assert drafters[-1].candidates["suffix"].cache is None
        assert gateway(node, model, speculate="auto").outputs is None  # opt-in
        with pytest.raises(ValueError, match="suffix drafting"):
            gateway(node, model, share_outputs=True)


async def test_a_client_going_away_after_its_whole_answer_cancels_nothing():
    """The server reports a disconnect once a client has read its whole answer and closed, from
    inside the answer's last send (hypercorn queues it there and yields after): that is no
    cancellation (every finished request was logged "cancelled: the client went away", and the
    work after the answer, such as closing the chain, was cut short). Before the answer ends, a
    disconnect cancels the generation."""
    from shardnet.gateway.server import _answer_sender, _cancel_on_disconnect

    for whole in (True, False):
        gone, answered, closed = trio.Event(), trio.Event(), trio.Event()
        finished = []

        async def receive():
            await closed.wait()
            return {"type": "http.disconnect"}

        async def send(message):  # as hypercorn's: the disconnect queued, then checkpoints
            if message["type"] == "http.response.body" and not message.get("more_body"):
                closed.set()
            for _ in range(5):
                await trio.sleep(0)

        async def generate(send_answer) -> None:
            await send_answer({"type": "http.response.start", "status": 200})
            await send_answer({"type": "http.response.body", "body": b"x", "more_body": not whole})
            if not whole:
                closed.set()  # the client goes away mid-answer
            await trio.sleep(0.5)  # (what follows the answer: closing the chain)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope, gone, answered)
            await generate(_answer_sender(send, answered))
            finished.append(True)
            nursery.cancel_scope.cancel()
        assert gone.is_set() is not whole and bool(finished) is whole
