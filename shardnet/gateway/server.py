"""An OpenAI-compatible HTTP server in front of a swarm: a plain ASGI app served by Hypercorn on
trio, in the same event loop as the node it generates through.

    POST /v1/completions, POST /v1/chat/completions (``stream: true``: server-sent events)
    GET /v1/models (with ``swarm``: every model the swarm serves), GET /health, GET /v1/swarm
    (``shardnet status --json``'s data), GET /livez and GET /readyz (for orchestrators),
    GET /metrics (Prometheus' text format: inference/metrics.py), GET /dashboard (and /) the
    swarm dashboard (gateway/dashboard.py); both outside /v1, so no API key

``/health`` answers 200 ``{"status": "ok"}`` only while every layer of the model is served by a
peer this gateway would route through, else 503 ``{"status": "unavailable", "missing_layers":
[...]}``: a load balancer sees what completions would see. Its ``requests`` counts completion
requests (probes of /health, /v1/models and /v1/swarm are not counted).

``/livez`` answers 200 while the process serves HTTP (it asks the swarm nothing: a liveness
probe must not fail because peers are away); ``/readyz`` is /health's answer (200 when the
gateway sees a full chain of the model, else 503 with ``reason``), with ``ready`` true or false.

With ``api_key``, every ``/v1/*`` request must carry ``Authorization: Bearer KEY`` or gets a 401
(code ``invalid_api_key``); the probes stay open. ``chat_template`` (Jinja text) replaces the
model's own chat template.

Each request runs its own chain session, so requests are served concurrently. Errors use
OpenAI's error shape with a fitting status: 400 bad input (``context_length_exceeded`` when the
prompt and ``max_tokens`` do not fit), 404 unknown model or path, 405, 408 a body that does not
arrive, 413 an oversize body, 503 when no chain covers the model (or requests waited in line
for a session past the queue timeout: code ``busy``), 502 when the swarm fails
mid-request (before anything was sent; a stream that fails later ends with an error event).
A client that disconnects before its answer is complete (streaming or not) cancels its
generation, which frees its chain.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import aclosing
from pathlib import Path

import trio

from shardnet.errors import NoRouteError, ShardnetError
from shardnet.inference.client.auto_drafter import drafter_for
from shardnet.inference.client.client import Client
from shardnet.inference.client.routing import format_layers, uncovered_layers
from shardnet.inference.client.suffix_drafter import SuffixCache
from shardnet.inference.swarm_status import swarm_report
from shardnet.protocols.activation import ErrorCode

from . import dashboard
from . import openai_api as oa
from .http import answer_lifespan, respond, serve_asgi

#: what a gateway's ``speculate`` takes: model-free drafters only (a draft model holds a cache per
#: sequence; one per concurrent request is not built)
GATEWAY_SPECULATE = ("auto", "suffix", "ngram", "none")

log = logging.getLogger(__name__)

BODY_TIMEOUT = 30.0
#: seconds a listing of the swarm's models is reused by /v1/models
MODELS_TTL = 30.0
SWARM_WAIT = 3.0
HEALTH_WAIT = 5.0  # the longest /health waits for the client's view of the claims


def chat_template_of(model_dir: Path) -> str | None:
    try:
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    t = cfg.get("chat_template")
    if isinstance(t, list):  # named templates: the default one
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


class Gateway:
    """The ASGI application. ``name``: the model name clients ask for (its ID works too)."""

    def __init__(self, client: Client, name: str, *, route_timeout: float = 10.0, api_key: str | None = None,
                 chat_template: str | None = None, speculate: str = "none", share_outputs: bool = False) -> None:
        if speculate not in GATEWAY_SPECULATE:
            raise ValueError(f"speculate={speculate!r}: one of {', '.join(GATEWAY_SPECULATE)}")
        if share_outputs and speculate not in ("auto", "suffix"):
            raise ValueError("sharing outputs is for suffix drafting: it needs speculate auto or suffix")
        self.client, self.name, self.route_timeout = client, name, route_timeout
        #: each request's drafter (auto: suffix matching or plain decoding, chosen as it goes), for
        #: a request that starts while no other is generating: with several at once the peers are
        #: busy computing, and verify chunks cost them more than the round trips they save
        self.speculate = speculate
        #: (opt-in) this gateway's recent outputs, which every request's suffix drafter also matches:
        #: other users' text shapes the drafts, not the output (greedy: verified, though a float16
        #: near-tie may tip; unseeded sampling: lossless; a seeded sampled request does not use them)
        self.outputs = SuffixCache() if share_outputs else None
        self.generating = 0  # requests generating now
        self.api_key = api_key or None
        self.model = client.model
        # a gateway routes through every layer range: its claims view hears every range's news
        # (a peer's load as it changes) besides its lookups (docs/protocols.md)
        client.planner.view.follow_all()
        self.created = oa.now()
        self.context = int(getattr(self.model.ckpt.config, "max_position_embeddings", 0) or 1 << 30)
        self.template = chat_template if chat_template is not None else chat_template_of(self.model.ckpt.path)
        self.requests = 0  # completion requests (not probes)
        self._swarm_models: tuple[float, list[dict]] | None = None
        shown = [dashboard.ShownModel(self.model.model_id, name, self.model.ckpt.num_layers)]
        self.dashboard = dashboard.DashboardPages(client.node, lambda: _value(shown), client.services.activity)

    # -- ASGI ----------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        routes = {("GET", "/health"): self.health, ("GET", "/v1/models"): self.models,
                  ("GET", "/v1/swarm"): self.swarm, ("GET", "/livez"): self.livez, ("GET", "/readyz"): self.readyz}
        try:
            if self.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
                oa.check_api_key(scope.get("headers", []), self.api_key)
            if (method, path) in routes:
                await _json(send, *await routes[(method, path)]())
            elif (method, path) == ("GET", "/metrics"):
                body, content_type = self.client.services.metrics.exposition()
                await respond(send, 200, body, content_type)
            elif method == "GET" and path in (*dashboard.PATHS, "/"):
                await respond(send, 200, *await self.dashboard.page("/dashboard" if path == "/" else path))
            elif (method, path) in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
                self.requests += 1
                await self.generate(path.endswith("chat/completions"), receive, send)
            elif path in {p for _, p in routes} | {"/v1/completions", "/v1/chat/completions", "/metrics", "/",
                                                    *dashboard.PATHS}:
                raise oa.ApiError(405, f"{method} is not allowed on {path}")
            else:
                raise oa.ApiError(404, f"no such endpoint: {method} {path}", code="unknown_url")
        except oa.ApiError as e:
            log.info("%s %s -> %d %s", method, path, e.status, e.message)
            await _json(send, e.status, e.body(), [(b"www-authenticate", b"Bearer")] if e.status == 401 else [])
        except Exception as e:  # the server keeps serving; the client gets a 500 with the reason
            log.exception("%s %s failed", method, path)
            await _json(send, 500, oa.ApiError(500, f"internal error: {e}", type="server_error").body())

    # -- simple endpoints ----------------------------------------------------------------------
    async def health(self) -> tuple[int, dict]:
        """200 while every layer is served by a peer this gateway would route through, else 503
        naming the layers nobody serves (read afresh from the client's view of the claims)."""
        node = self.client.node
        num_layers = self.model.ckpt.num_layers
        claims = None
        with trio.move_on_after(HEALTH_WAIT):
            claims = await self.client.planner.usable_claims()
        missing = list(range(num_layers)) if claims is None else uncovered_layers(claims, num_layers)
        body = {"status": "unavailable" if missing else "ok", "model": self.name, "model_id": self.model.model_id,
                "peer_id": str(node.peer_id), "connected_peers": len(node.peers()), "requests": self.requests,
                "num_layers": num_layers, "missing_layers": missing}
        if missing:
            body["reason"] = ("no claims could be read within %g s" % HEALTH_WAIT if claims is None
                              else f"no live peer serves layers {format_layers(missing)}")
        return (503 if missing else 200), body

    async def livez(self) -> tuple[int, dict]:
        """Alive: this process answers HTTP. Asks the swarm nothing."""
        return 200, {"status": "alive"}

    async def readyz(self) -> tuple[int, dict]:
        """Ready: a request would find a full chain of the model now (/health's view)."""
        status, body = await self.health()
        return status, {**body, "ready": status == 200}

    async def models(self) -> tuple[int, dict]:
        """The model this gateway serves, and (key ``swarm``) every model the swarm serves, as
        ``shardnet models --json`` lists them (looked up at most every MODELS_TTL seconds)."""
        from shardnet.inference.weights.cards import list_models

        now = trio.current_time()
        if self._swarm_models is None or now - self._swarm_models[0] > MODELS_TTL or not self._swarm_models[1]:
            try:
                found = [m.to_json() for m in await list_models(self.client.node, timeout=SWARM_WAIT)]
            except ShardnetError as e:
                log.info("listing the swarm's models failed: %s", e)
                found = self._swarm_models[1] if self._swarm_models else []
            self._swarm_models = (now, found)
        body = oa.models_body(self.name, self.created)
        body["data"][0]["shardnet"] = {"model_id": self.model.model_id, "family": self.model.ckpt.model_type,
                                       "num_layers": self.model.ckpt.num_layers}
        body["swarm"] = self._swarm_models[1]
        return 200, body

    async def swarm(self) -> tuple[int, dict]:
        return 200, await swarm_report(self.client.node, self.model.model_id, self.model.ckpt.num_layers,
                                       wait=SWARM_WAIT)

    # -- generation ----------------------------------------------------------------------------
    def _render_chat(self, messages: list[dict]) -> str:
        if self.template is None:
            raise oa.ApiError(400, f"model {self.name} has no chat template; use /v1/completions", param="model")
        tok = self.model.tokenizer
        bos = tok.id_to_token(self.model.ckpt.raw_config.get("bos_token_id") or 0) or ""
        return oa.render_chat_template(self.template, messages, bos_token=bos,
                                       eos_token=tok.id_to_token(min(self.model.eos_ids, default=0)) or "")

    async def _request(self, chat: bool, receive) -> tuple[oa.GenerationRequest, list[int], int]:
        body = await _read_body(receive)
        req = oa.parse_request(oa.parse_json(body), chat=chat, render_chat=self._render_chat,
                               vocab_size=self.model.ckpt.config.vocab_size)
        if req.model not in (self.name, self.model.model_id):
            raise oa.ApiError(404, f"the model {req.model!r} does not exist here (this server serves "
                              f"{self.name!r})", param="model", code="model_not_found")
        ids = self.model.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        vocab = self.model.ckpt.config.vocab_size
        if any(t >= vocab for t in ids):
            raise oa.ApiError(400, f"token ids must be below the vocabulary size {vocab}", param="prompt")
        room = self.context - len(ids)
        max_new = req.max_tokens if req.max_tokens is not None else room
        if room < 1 or max_new > room:
            raise oa.ApiError(400, f"this model's context is {self.context} tokens; the prompt has {len(ids)} and "
                              f"{max_new} more were asked for", param="max_tokens" if room >= 1 else "messages"
                              if chat else "prompt", code="context_length_exceeded")
        return req, ids, max_new

    async def _route(self):
        try:
            return await self.client.planner.find_route(timeout=self.route_timeout)
        except NoRouteError as e:
            raise oa.ApiError(503, f"the swarm cannot serve the model now: {e}", type="server_error",
                              code="no_route") from None

    def _tokens(self, req: oa.GenerationRequest, ids: list[int], max_new: int, route):
        alone = self.generating <= 1
        # (not for a seeded sampled request: which drafts were sent decides which numbers draw which
        # token, so other users' outputs would change its text)
        shared = self.outputs if req.temperature == 0 or req.seed is None else None
        drafter = drafter_for(self.speculate if alone else "none", vocab_size=self.model.ckpt.config.vocab_size,
                              suffix_cache=shared)
        tokens = self.client.generate(ids, max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
                                      seed=req.seed, frequency_penalty=req.frequency_penalty,
                                      presence_penalty=req.presence_penalty, logit_bias=req.logit_bias,
                                      logprobs=req.logprobs, route=route, drafter=drafter)
        return tokens if self.outputs is None else self._shared(tokens)

    async def _shared(self, tokens):
        """``tokens``, passed on; what they made goes into the shared outputs once they end (a
        request cut short by a stop sequence or a disconnect included: it is real output)."""
        out: list[int] = []
        try:
            async with aclosing(tokens) as gen:
                async for tok in gen:
                    tok.apply(out)
                    yield tok
        finally:
            self.outputs.add(out)

    def _logprob_entry(self, tok, offset: int) -> oa.LogprobEntry:
        return oa.LogprobEntry(tok.text, tok.logprob, [(self.model.decode([t]), lp) for t, lp in tok.top_logprobs],
                               offset)

    async def generate(self, chat: bool, receive, send) -> None:
        req, ids, max_new = await self._request(chat, receive)
        rid = oa.new_id(chat)
        t0 = time.perf_counter()
        gone, answered = trio.Event(), trio.Event()
        send_answer = _answer_sender(send, answered)
        # A client that goes away (streaming or not) cancels its generation and frees its chain;
        # once it has the whole answer, its going away (the server reports it then) cancels nothing
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope, gone, answered)
                await self._generate(req, ids, max_new, rid, send_answer)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:  # the request's own error (an ApiError: its status), unwrapped
            if len(eg.exceptions) == 1:
                raise eg.exceptions[0] from None
            raise
        log.info("%s: %d prompt tokens, %s in %.2f s", rid, len(ids),
                 "cancelled: the client went away" if gone.is_set() else "done", time.perf_counter() - t0)

    async def _generate(self, req, ids, max_new, rid, send) -> None:
        self.generating += 1
        try:
            await self._generate_counted(req, ids, max_new, rid, send)
        finally:
            self.generating -= 1

    async def _generate_counted(self, req, ids, max_new, rid, send) -> None:
        route = await self._route()
        created = oa.now()
        log.info("%s: generating up to %d tokens after %d prompt tokens", rid, max_new, len(ids))
        if req.stream:
            await self._stream(req, ids, max_new, route, rid, created, send)
        else:
            out: list[int] = []
            entries: list[oa.LogprobEntry] = []  # (with logprobs asked for) one per token of out
            text, stopped = "", False
            try:
                async with aclosing(self._tokens(req, ids, max_new, route)) as tokens:
                    async for tok in tokens:
                        tok.apply(out)
                        if req.logprobs is not None:
                            del entries[len(entries) - tok.retracted:]  # (withdrawn tokens' entries go too)
                            if tok.id is not None:
                                entries.append(self._logprob_entry(tok, len(self.model.decode(out[:-1]))))
                        text = self.model.decode(out)  # the whole text each time: tokens may be withdrawn
                        cut = oa.first_stop(text, req.stop)
                        if cut >= 0:
                            text, stopped = text[:cut], True
                            break
            except ShardnetError as e:
                if e.code == ErrorCode.BUSY:  # waited in line past the client's queue timeout
                    raise oa.ApiError(503, f"the swarm is busy: {e}", type="server_error", code="busy") from None
                raise oa.ApiError(502, f"the swarm failed during generation: {e}", type="server_error",
                                  code="swarm_error") from None
            finish = "length" if len(out) >= max_new and not stopped else "stop"
            if stopped:  # the tokens a stop sequence cut off are not in the answer
                entries = [e for e in entries if e.offset < len(text)]
            if req.echo:
                shown = self.model.decode(ids)
                text = shown + text
                for e in entries:
                    e.offset += len(shown)
            await _json(send, 200, oa.response_body(req, rid, created, text, finish, oa.usage(len(ids), len(out)),
                                                    entries))

    async def _stream(self, req, ids, max_new, route, rid, created, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})

        async def event(data) -> None:
            await send({"type": "http.response.body", "body": oa.sse(data), "more_body": True})

        stop = oa.StopMatcher(req.stop)
        n = 0
        finish = "length"
        pending: list[oa.LogprobEntry] = []  # of tokens whose text has not gone out yet
        sent_chars = 0
        try:
            if req.chat:
                await event(oa.chunk_body(req, rid, created, role=True, text=""))
            elif req.echo:
                await event(oa.chunk_body(req, rid, created, text=self.model.decode(ids)))
            async with aclosing(self._tokens(req, ids, max_new, route)) as tokens:
                async for tok in tokens:
                    if tok.retracted:
                        # text already sent cannot be taken back: say so and end the stream
                        raise ShardnetError(f"a peer was caught computing wrong; {tok.retracted} token(s) "
                                            "already sent were withdrawn: retry the request")
                    n += 1
                    if req.logprobs is not None:
                        pending.append(self._logprob_entry(tok, sent_chars + sum(len(e.text) for e in pending)))
                    piece = stop.feed(tok.text)
                    if piece:
                        await event(oa.chunk_body(req, rid, created, text=piece, logprobs=pending))
                        sent_chars += len(piece)
                        pending = []
                    if stop.stopped:
                        finish = "stop"
                        break
            if not stop.stopped:
                if piece := stop.flush():
                    await event(oa.chunk_body(req, rid, created, text=piece, logprobs=pending))
                finish = "length" if n >= max_new else "stop"
            await event(oa.chunk_body(req, rid, created, finish=finish, text=None if req.chat else ""))
            if req.include_usage:
                await event(oa.chunk_body(req, rid, created, use=oa.usage(len(ids), n)))
        except ShardnetError as e:
            log.warning("%s: stream ended early: %s", rid, e)
            await event(oa.ApiError(502, str(e), type="server_error", code="swarm_error").body())
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _value(x):
    return x


async def _read_body(receive) -> bytes:
    body = b""
    try:
        with trio.fail_after(BODY_TIMEOUT):
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise oa.ApiError(400, "the client went away before sending its request")
                body += msg.get("body", b"")
                if len(body) > oa.MAX_BODY_BYTES:
                    raise oa.ApiError(413, f"request body exceeds {oa.MAX_BODY_BYTES} bytes")
                if not msg.get("more_body"):
                    return body
    except trio.TooSlowError:
        raise oa.ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT:g} s") from None


def _answer_sender(send, answered: trio.Event):
    """``send``, setting ``answered`` as the answer's last part goes: hypercorn queues the
    client's disconnect inside that last send and yields after it, so the watcher
    (``_cancel_on_disconnect``) must find the answer given when it wakes; the send is shielded
    (the answer is out: nothing left to cancel)."""
    async def send_answer(message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()
            with trio.CancelScope(shield=True):
                await send(message)
            return
        await send(message)

    return send_answer


async def _cancel_on_disconnect(receive, scope: trio.CancelScope, gone: trio.Event, answered: trio.Event) -> None:
    """A client that goes away before it has its whole answer stops its generation (and frees
    its chain)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if answered.is_set():
        return
    log.info("client disconnected: generation cancelled")
    gone.set()
    scope.cancel()


async def _json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await respond(send, status, json.dumps(body).encode(), "application/json", headers)


def read_chat_template(path: Path) -> str:
    """A chat template file (Jinja, as in a tokenizer_config.json's ``chat_template``), checked."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ShardnetError(f"chat template {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not text.strip():
        raise ShardnetError(f"chat template {path}: the file is empty")
    if (why := oa.check_chat_template(text)) is not None:
        raise ShardnetError(f"chat template {path}: not a valid Jinja template ({why})")
    return text


async def serve_gateway(client: Client, name: str, *, host: str = "127.0.0.1", port: int = 8000,
                        route_timeout: float = 10.0, api_key: str | None = None, chat_template: str | None = None,
                        speculate: str = "none", share_outputs: bool = False,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; ``task_status.started`` gets the bound URLs."""
    gateway = Gateway(client, name, route_timeout=route_timeout, api_key=api_key, chat_template=chat_template,
                      speculate=speculate, share_outputs=share_outputs)
    await serve_asgi(gateway, host=host, port=port, task_status=task_status)
