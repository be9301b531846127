"""The OpenAI HTTP API's shapes, without I/O: request validation, response and stream-chunk
bodies, error bodies, stop sequences, chat templates.

Requests are validated by pydantic models (strict: JSON types as sent). Only what shardnet can
honour is accepted: ``n`` must be 1, and options that change what is computed but are not
supported (``best_of`` > 1, tools) are refused with a 400 naming the parameter, rather than
silently ignored. ``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` (token id ->
-100..100) are applied as OpenAI defines them (inference/client/sampling.adjusted);
``logprobs`` (completions: 0..5 alternatives; chat: ``logprobs: true`` and ``top_logprobs``
0..20) gives each token's log-probability in OpenAI's shapes (``LogprobEntry``). Options that
only concern presentation or accounting (``user``, ...) pass.

A chat message's ``content`` is a string or a list of content parts; text parts
(``{"type": "text", "text": ...}``) are joined with newlines, and any other part (``image_url``,
``input_audio``, ...) is refused with a 400 naming ``messages``: the models are text-only.

With an API key (``serve --api-key``), every ``/v1/*`` request must carry ``Authorization:
Bearer KEY`` (``check_api_key``); otherwise a 401 in OpenAI's shape, code ``invalid_api_key``.

``top_p`` takes OpenAI's whole range 0..1: 0 keeps only the most likely token (the tiniest
nucleus), which is greedy decoding, and is sent to the swarm as ``temperature`` 0.

A body is refused with a 400 (never a 500) when it is not JSON, nests deeper than
``MAX_DEPTH``, or holds text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``,
which JSON can spell but no tokenizer can encode).
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_BODY_BYTES = 1 << 20
MAX_STOP = 4
MAX_DEPTH = 32  # nesting of a request body (a chat request needs 3)
DEFAULT_MAX_TOKENS = 16  # /v1/completions' documented default
UNSUPPORTED = ("tools", "functions", "response_format", "suffix")
#: the most alternatives per token: /v1/completions' logprobs, /v1/chat/completions' top_logprobs
MAX_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20
#: the most tokens one logit_bias may name
MAX_LOGIT_BIAS = 1024
#: how the text parts of one message's content are joined (as vLLM does)
PART_SEPARATOR = "\n"


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerationRequest:
    """What /v1/completions and /v1/chat/completions ask for, validated."""

    chat: bool
    model: str
    prompt: str | list[int]  # text (rendered through the chat template for chat) or token ids
    max_tokens: int | None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: not asked for; N: each token's and N alternatives'


def parse_json(body: bytes) -> dict:
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON ({e})") from None
    except RecursionError:  # the decoder's own limit (about 1000 levels)
        raise ApiError(400, f"request body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_structure(data)
    return data


def _check_structure(data: dict) -> None:
    """Refuse bodies nested deeper than MAX_DEPTH and text that is not valid Unicode (lone
    surrogates), naming the top-level field. Iterative: no recursion on hostile input."""
    stack: list[tuple[object, str, int]] = [(v, k, 1) for k, v in data.items()]
    stack.append((list(data), "", 1))  # the keys are text too
    while stack:
        v, field, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"request body nests deeper than {MAX_DEPTH} levels", param=field or None)
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"{field or 'a field name'} is not valid Unicode text: it holds a lone "
                               f"surrogate ({v[e.start]!r}) at position {e.start}",
                               param=field or None) from None
        elif isinstance(v, dict):
            stack.extend((x, field, depth + 1) for x in v.values())
            stack.append((list(v), field, depth + 1))
        elif isinstance(v, list):
            stack.extend((x, field, depth + 1) for x in v)


Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
OptInt = Annotated[int, Field(ge=1)] | None


class _Body(BaseModel):
    """What both endpoints take. Strict: JSON types as they are (``true`` is not a number);
    fields not named here pass (presentation and accounting options)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: Text
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    max_tokens: OptInt = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stream: bool | None = None
    stream_options: dict | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    n: Literal[1] | None = None
    best_of: Literal[1] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | Annotated[list[dict], Field(min_length=1)]  # text, or content parts (checked after)


class _Completion(_Body):
    prompt: Text | TokenIds | Annotated[list[Text | TokenIds], Field(min_length=1, max_length=1)]  # a batch of one
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class _Chat(_Body):
    messages: Annotated[list[_Message], Field(min_length=1)]
    max_completion_tokens: OptInt = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


#: messages for fields whose pydantic errors (one per member of a union) would not read well
_MESSAGES = {
    "model": "model is required (a non-empty string)",
    "prompt": "prompt must be a non-empty string or list of token ids (one prompt per request)",
    "messages": "messages must be a non-empty list of objects with a string role and a content that is a "
                "string or a non-empty list of content parts",
    "stop": f"stop must be a string or a list of at most {MAX_STOP} non-empty strings",
    "n": "only n = 1 is supported",
    "best_of": "only best_of = 1 is supported",
    "stream": "stream must be true or false",
    "stream_options": "stream_options must be an object",
    "frequency_penalty": "frequency_penalty must be a number from -2 to 2",
    "presence_penalty": "presence_penalty must be a number from -2 to 2",
    "logit_bias": f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers from -100 to 100",
    "logprobs": f"logprobs must be true or false (chat) or a number of alternatives from 0 to {MAX_LOGPROBS} "
                "(completions)",
    "top_logprobs": f"top_logprobs must be a number from 0 to {MAX_TOP_LOGPROBS}",
}


def _api_error(e: ValidationError) -> ApiError:
    """The first problem pydantic found, as OpenAI's 400 naming the parameter."""
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else None
    where = ".".join(str(x) for x in err["loc"])
    message = _MESSAGES.get(param) or f"{where}: {err['msg']}"
    if param == "messages" and len(err["loc"]) > 1 and isinstance(err["loc"][1], int):
        message += f" (messages[{err['loc'][1]}])"
    return ApiError(400, message, param=param)


def message_text(content: str | list[dict], index: int) -> str:
    """A message's content as text: a string as it is; content parts' texts joined. Any part
    that is not text (an image, audio, a file) is refused: the models read text only."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        where = f"messages[{index}].content[{j}]"
        if kind != "text":
            what = f"type {kind!r}" if isinstance(kind, str) else "no type"
            raise ApiError(400, f"{where}: content parts of {what} are not supported: this server's models "
                           "read text only (use parts of type 'text')", param="messages")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}: a text part needs a string 'text'", param="messages")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float]:
    """OpenAI's logit_bias (keys: token ids as strings) as {token: bias}, checked."""
    out = {}
    for key, b in (bias or {}).items():
        if not key.isdigit():
            raise ApiError(400, f"logit_bias: {key!r} is not a token id (a string of digits)", param="logit_bias")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise ApiError(400, f"logit_bias: token {token} is not in the model's vocabulary (0..{vocab_size - 1})",
                           param="logit_bias")
        out[token] = float(b)
    return out


def parse_request(data: dict, *, chat: bool, render_chat=None, vocab_size: int | None = None) -> GenerationRequest:
    """Validate a request body; ``render_chat(messages) -> str`` applies the chat template;
    ``vocab_size`` bounds the token ids logit_bias may name."""
    for name in UNSUPPORTED:
        if data.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    try:
        body = (_Chat if chat else _Completion).model_validate(data)
    except ValidationError as e:
        raise _api_error(e) from None
    logit_bias = _logit_bias(body.logit_bias, vocab_size)
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    if chat:
        messages = [{**m.model_dump(), "content": message_text(m.content, i)} for i, m in enumerate(body.messages)]
        prompt: str | list[int] = render_chat(messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    else:
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list)) \
            else body.prompt
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0:  # the tiniest nucleus: only the most likely token, i.e. greedy decoding
        temperature, top_p = 0.0, 1.0
    stop = [] if body.stop is None else [body.stop] if isinstance(body.stop, str) else body.stop
    return GenerationRequest(
        chat=chat, model=body.model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        stop=stop, seed=body.seed, stream=bool(body.stream),
        include_usage=bool((body.stream_options or {}).get("include_usage")),
        echo=bool(data.get("echo")) and not chat, frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0, logit_bias=logit_bias, logprobs=logprobs)


def first_stop(text: str, stops: list[str], start: int = 0) -> int:
    """Where the first stop sequence in ``text`` (at or after ``start``) begins; -1 if none does."""
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)


class StopMatcher:
    """Cut generated text at the first stop sequence; while streaming, hold back any tail that
    could still become one, so no part of a stop sequence is ever sent."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""  # everything generated
        self.sent = 0  # how much of it has been released
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add generated text; returns what may be released now ("" once stopped)."""
        if self.stopped:
            return ""
        self.text += piece
        # (a stop sequence cannot start in released text: its start would have been held back)
        cut = first_stop(self.text, self.stops, self.sent)
        if cut >= 0:
            self.stopped = True
            out, self.sent = self.text[self.sent:cut], cut
            self.text = self.text[:cut]
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def flush(self) -> str:
        """At the end of generation: the held-back tail (it never became a stop sequence)."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def _template_env():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ApiError(400, f"chat template: {message}", param="messages")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


def check_chat_template(template: str) -> str | None:
    """Why a chat template (Jinja) cannot be used, or None: a syntax error, with its line."""
    from jinja2 import TemplateSyntaxError

    try:
        _template_env().from_string(template)
    except TemplateSyntaxError as e:
        return f"line {e.lineno}: {e.message}"
    return None


def render_chat_template(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "") -> str:
    """A Hugging Face chat template (Jinja) rendered in a sandbox, ready for the assistant's turn."""
    from jinja2 import TemplateError

    env = _template_env()
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                bos_token=bos_token, eos_token=eos_token)
    except TemplateError as e:
        raise ApiError(400, f"the model's chat template failed on these messages ({e})", param="messages") from None


def check_api_key(headers: list[tuple[bytes, bytes]], api_key: str) -> None:
    """Raise a 401 unless the ASGI ``headers`` carry ``Authorization: Bearer <api_key>``.
    Compared in constant time, so response timing does not reveal how much of a guess matched."""
    given = next((v for k, v in headers if k.lower() == b"authorization"), None)
    if given is None:
        raise ApiError(401, "no API key given: send the header 'Authorization: Bearer YOUR_KEY'",
                       code="invalid_api_key")
    scheme, _, token = given.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), api_key.encode()):
        raise ApiError(401, "incorrect API key provided", code="invalid_api_key")


# -- response bodies ---------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class LogprobEntry:
    """One generated token's log-probability, as the gateway reports it: its text, and the most
    likely tokens' (text, log-probability). ``offset``: where its text starts in the completion."""

    text: str
    logprob: float
    top: list[tuple[str, float]]
    offset: int = 0


def logprobs_body(req: GenerationRequest, entries: list[LogprobEntry] | None) -> dict | None:
    """A choice's ``logprobs`` in the endpoint's shape (None when they were not asked for)."""
    if req.logprobs is None or entries is None:
        return None
    if req.chat:
        def one(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**one(e.text, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries] if req.logprobs else None,
            "text_offset": [e.offset for e in entries]}


def response_body(req: GenerationRequest, rid: str, created: int, text: str, finish: str, use: dict,
                  logprobs: list[LogprobEntry] | None = None) -> dict:
    lp = logprobs_body(req, logprobs)
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": lp}
        return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [choice], "usage": use}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}], "usage": use}


def chunk_body(req: GenerationRequest, rid: str, created: int, *, text: str | None = None, role: bool = False,
               finish: str | None = None, use: dict | None = None, logprobs: list[LogprobEntry] | None = None) -> dict:
    """One server-sent event's data. ``use`` alone: the final usage chunk (empty choices).
    ``logprobs``: those of the tokens whose text this chunk carries."""
    lp = logprobs_body(req, logprobs)
    if req.chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [] if use is not None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": choices}
    else:
        choices = [] if use is not None else [{"index": 0, "text": text or "", "logprobs": lp,
                                               "finish_reason": finish}]
        body = {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def sse(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


def models_body(name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "shardnet"}]}


def now() -> int:
    return int(time.time())
