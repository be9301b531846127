"""Helpers shared by the tests and benchmarks: ports, loopback configs, in-process chains, and
what single-process ``transformers`` generates (the reference every distributed run must match).

Imported explicitly (``from shardnet.testing.helpers import ...``), never through conftest."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import time
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from shardnet.testing.localswarm import free_port, shardnet_argv  # noqa: F401 (free_port: for tests)

#: the repository root (tests, benches, examples and fuzz targets live beside the package)
REPO_ROOT = Path(__file__).resolve().parents[2]


def bench_stdout(module: str, *args: str, timeout: float) -> str:
    """Run a bench as its smoke tests do (``python -m bench.NAME ARGS`` from the repository root)
    and return what it printed; it must exit 0 (the assertion shows the end of its stderr)."""
    import sys

    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                       timeout=timeout, check=False, cwd=REPO_ROOT)
    assert r.returncode == 0, f"{module} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def transformers_model(path, dtype: str | None = None):
    """The checkpoint at ``path`` as single-process transformers loads it, for inference: in its own
    dtype (``dtype=None``: transformers' default, as shardnet's ``--dtype auto``) or in ``dtype``
    (``"float32"``)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **({"dtype": getattr(torch, dtype)} if dtype else {})).eval()


def transformers_generate(model, input_ids, new: int | None = None, **generate_kw):
    """transformers' own greedy ``generate`` on ``input_ids`` (a batch, every position attended):
    the whole sequences, as it returns them. ``model`` is a loaded model or a checkpoint's path
    (loaded in its own dtype). With ``new``: exactly ``new`` tokens, past any end of sequence;
    without: as ``generate_kw`` (``max_new_tokens=``) and the checkpoint's generation config say."""
    import torch

    if isinstance(model, (str, os.PathLike)):
        model = transformers_model(model)
    if new is not None:
        generate_kw = {"max_new_tokens": new, "min_new_tokens": new, "eos_token_id": None, "pad_token_id": 0,
                       **generate_kw}
    with torch.inference_mode():
        return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, **generate_kw)


def transformers_greedy(path, prompt: str, new: int, *, penalties: dict | None = None) -> list[int]:
    """The ``new`` tokens plain single-process transformers generates greedily after ``prompt``,
    loaded as transformers loads it by default (in the checkpoint's dtype, as shardnet's
    ``--dtype auto``): what every distributed run must reproduce. ``penalties``: the OpenAI
    adjustment a request asks for (``frequency_penalty``, ``presence_penalty``, ``logit_bias``),
    applied to the logits before each choice."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LogitsProcessorList

    ids = Tokenizer.from_file(str(Path(path) / "tokenizer.json")).encode(prompt).ids
    kw = {"logits_processor": LogitsProcessorList([_openai_penalties(len(ids), **penalties)])} if penalties else {}
    return transformers_generate(path, torch.tensor([ids]), new, **kw)[0, len(ids):].tolist()


def _openai_penalties(prompt_len: int, *, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=None):
    """A transformers logits processor applying OpenAI's formula: each ``logit_bias`` added, and for
    each token generated n times so far (the prompt not counted), ``n * frequency_penalty +
    presence_penalty`` subtracted."""
    from collections import Counter

    from transformers import LogitsProcessor

    class OpenAIPenalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for token, bias in (logit_bias or {}).items():
                scores[:, token] += bias
            for row, generated in enumerate(input_ids[:, prompt_len:].tolist()):
                for token, n in Counter(generated).items():
                    scores[row, token] -= n * frequency_penalty + presence_penalty
            return scores

    return OpenAIPenalties()


def http_request(url: str, method: str, path: str, body=None, headers=None) -> tuple[int, bytes]:
    """One plain HTTP request to ``url`` (http://HOST:PORT): its status and body."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


def wait_healthy(url: str, timeout: float = 90) -> dict:
    """A gateway's /health until it answers 200: every layer served by a peer it would route through."""
    deadline = time.monotonic() + timeout
    while True:
        status, data = http_request(url, "GET", "/health")
        body = json.loads(data)
        if status == 200:
            return body
        assert status == 503 and body["status"] == "unavailable" and body["missing_layers"], body
        assert time.monotonic() < deadline, body
        time.sleep(0.5)


def loopback_config(**kw):
    """A NodeConfig listening on a free loopback port, with short dial timeouts."""
    from shardnet.transport.config import NodeConfig

    kw.setdefault("listen", ["/ip4/127.0.0.1/tcp/0"])
    kw.setdefault("dial_timeout", 5.0)
    return NodeConfig(**kw)


@asynccontextmanager
async def local_chain(config, path, ranges, *, served: list | None = None, **serve_kw):
    """A bootstrap, one node per layer range serving it, and a client node (all in this process);
    yields the client node once it has joined. ``config(**kw)`` makes each node's NodeConfig.
    ``served``: a list the ``ServedBlock`` of each range is appended to (its scheduler, KV budget)."""
    from shardnet.inference.server.compute_peer import serve_block
    from shardnet.transport import open_node

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(config()))
        cfg = config(bootstrap=[str(boot.listen_addrs[0])])
        for a, b in ranges:
            peer = await stack.enter_async_context(open_node(cfg))
            block = await stack.enter_async_context(serve_block(peer, str(path), a, b, **serve_kw))
            if served is not None:
                served.append(block)
        client_node = await stack.enter_async_context(open_node(cfg))
        await client_node.wait_bootstrapped()
        yield client_node


#: a well-formed peer ID nobody holds
FAKE_ID = "12D3KooWJ6qwgeXYApCdiMkT5Yx3Dse7BVqQ3hSXTGzoi2hA5Ffk"


def shardnet(*args, timeout=60, env=None):
    """Run the ``shardnet`` command (this interpreter's), capturing its output."""
    return subprocess.run(shardnet_argv(*args), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def openai_client(url: str, *, timeout: float):
    """The official OpenAI client for a gateway at ``url`` (no retries: a failure shows)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def one_line(e) -> str:
    """An error's message, asserted to be one line (what a user would see)."""
    assert "\n" not in str(e)
    return str(e)


def assert_one_line_failure(r, pattern):
    """A CLI failure as users must see it: non-zero exit, no traceback, one ``error:`` line."""
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    assert re.search(pattern, errors[0]), errors[0]


#: the prompt (token IDs) and length of the exactness tests: chain vs transformers in one process
EXACT_PROMPT = [3, 17, 42, 99, 7, 250, 11]
EXACT_NEW_TOKENS = 12
#: max |logit difference| in float32 between a chain and transformers in one process
LOGIT_TOL = 1e-4


async def each_at_once(n: int, one, seconds: float) -> None:
    """``await one(i)`` for every i in 0..n-1, all at once, within ``seconds``."""
    import trio

    with trio.fail_after(seconds):
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)


def assert_greedy_texts(got: dict[int, list[int]], prompts: list[list[int]], new: int, path=None) -> None:
    """``got[i]`` is single-process transformers' greedy continuation of ``prompts[i]`` (float32)."""
    from shardnet.models import default_model_path

    for i, p in enumerate(prompts):
        assert got[i] == transformers_reference(path or default_model_path(), p, new)[0], i


def transformers_reference(path, prompt: list[int], new: int, dtype="float32"):
    """transformers' greedy continuation of token IDs ``prompt`` and the logits of its last
    position, in float32 (or, with ``dtype=None``, in the checkpoint's own dtype: transformers'
    default load)."""
    import torch

    model = transformers_model(path, dtype)
    out = transformers_generate(model, torch.tensor([prompt]), new)
    with torch.inference_mode():
        logits = model(out[:, :-1]).logits[0, -1].float()
    return out[0].tolist()[len(prompt):], logits


async def chain_token_ids(client, prompt: list[int], new: int, **kw) -> list[int]:
    return [t.id async for t in client.generate(prompt, max_new_tokens=new, stop_at_eos=False, **kw)]


async def chain_last_logits(client, seq: list[int]):
    """Logits for the last position of ``seq`` through the chain (prefill all but one, then one)."""
    import torch

    async with client.session(len(seq) + 1) as sess:
        await sess.forward(client.model.head.embed(torch.tensor([seq[:-2]])))
        out = await sess.forward(client.model.head.embed(torch.tensor([seq[-2:-1]])))
    return out[0, -1].float() if client.request.logits_on_last else client.model.head.logits(out)[0, -1]
