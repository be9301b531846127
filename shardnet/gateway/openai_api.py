"""The OpenAI HTTP API's shapes, without I/O: request validation, response and stream-chunk
bodies, error bodies, stop sequences, chat templates.

Only what shardnet can honour is accepted: ``n`` must be 1, and options that change what is
computed but are not supported (``logprobs``, ``best_of`` > 1, ``logit_bias``, tools) are refused
with a 400 naming the parameter, rather than silently ignored. Options that only concern
presentation or accounting (``user``, ``presence_penalty`` = 0, ...) pass.

``top_p`` takes OpenAI's whole range 0..1: 0 keeps only the most likely token (the tiniest
nucleus), which is greedy decoding, and is sent to the swarm as ``temperature`` 0.

A body is refused with a 400 (never a 500) when it is not JSON, nests deeper than
``MAX_DEPTH``, or holds text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``,
which JSON can spell but no tokenizer can encode).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

MAX_BODY_BYTES = 1 << 20
MAX_STOP = 4
MAX_DEPTH = 32  # nesting of a request body (a chat request needs 3)
DEFAULT_MAX_TOKENS = 16  # /v1/completions' documented default
UNSUPPORTED = ("logprobs", "top_logprobs", "logit_bias", "tools", "functions", "response_format", "suffix")


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


def _number(data: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = data.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ApiError(400, f"{name} must be a number between {lo:g} and {hi:g}", param=name)
    return float(v)


def _int(data: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = data.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise ApiError(400, f"{name} must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""),
                       param=name)
    return v


def parse_request(data: dict, *, chat: bool, render_chat=None) -> GenerationRequest:
    """Validate a request body; ``render_chat(messages) -> str`` applies the chat template."""
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required", param="model")
    for name in UNSUPPORTED:
        if data.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    if data.get("n", 1) != 1 or data.get("best_of", 1) != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    if chat:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ApiError(400, f"messages[{i}] must have a string role and string content", param="messages")
        prompt: str | list[int] = render_chat(messages)
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                          and t >= 0 for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids:
            raise ApiError(400, "prompt must be a non-empty string or list of token ids (one prompt per request)",
                           param="prompt")
    stop = data.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOP} non-empty strings", param="stop")
    max_name = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(data, max_name, 1)
    if max_tokens is None and not chat:
        max_tokens = DEFAULT_MAX_TOKENS
    opts = data.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    temperature, top_p = _number(data, "temperature", 1.0, 0.0, 2.0), _number(data, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:  # the tiniest nucleus: only the most likely token, i.e. greedy decoding
        temperature, top_p = 0.0, 1.0
    return GenerationRequest(
        chat=chat, model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        stop=stop, seed=_int(data, "seed", -(2**63), 2**63 - 1), stream=stream,
        include_usage=bool(opts.get("include_usage")), echo=bool(data.get("echo")) and not chat)


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


def render_chat_template(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "") -> str:
    """A Hugging Face chat template (Jinja) rendered in a sandbox, ready for the assistant's turn."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ApiError(400, f"chat template: {message}", param="messages")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                bos_token=bos_token, eos_token=eos_token)
    except TemplateError as e:
        raise ApiError(400, f"the model's chat template failed on these messages ({e})", param="messages") from None


# -- response bodies ---------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(req: GenerationRequest, rid: str, created: int, text: str, finish: str, use: dict) -> dict:
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
        return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [choice], "usage": use}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": use}


def chunk_body(req: GenerationRequest, rid: str, created: int, *, text: str | None = None, role: bool = False,
               finish: str | None = None, use: dict | None = None) -> dict:
    """One server-sent event's data. ``use`` alone: the final usage chunk (empty choices)."""
    if req.chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choices = [] if use is not None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": choices}
    else:
        choices = [] if use is not None else [{"index": 0, "text": text or "", "logprobs": None,
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
