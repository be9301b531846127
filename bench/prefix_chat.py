"""Two-turn chats through `shardnet serve`, prefix reuse off vs private: time to first token of each turn.

    python -m bench.prefix_chat [--first-turn 1500] [--conversations 3] [--repeats 3] [--answer-tokens 16]
                                [--hidden N] [--dtype float32] [--threads 1] [--quick]

The issue's target (issue 35): a two-turn chat whose second turn resends a 1,500-token first
turn: the second turn's time to first token <= 0.25x the first's.

A bootstrap, 2 compute peers (``shardnet join --layers 0:4`` and ``4:8``, one torch thread each,
a KV budget sized to hold every session and its prefix pages) and TWO gateways on that swarm, run
as processes on loopback (shardnet.testing.localswarm): ``shardnet serve --prefix-reuse off`` and
``--prefix-reuse private``; nothing else differs, so the ratio between them is the reuse's.

Per conversation (a long system prompt and a question; a pasted document; a pasted module of
code), with each gateway in turn, through the official ``openai`` client, greedy (temperature
0), streamed: turn 1 = messages of about ``--first-turn`` tokens (the text is built until
the model's tokenizer counts that many), ``--answer-tokens`` new tokens; turn 2 = the whole
conversation resent (turn 1, the assistant's answer, a short new question); the end-of-sequence
token is kept out (``logit_bias``) so that every turn answers. The time to first
token (TTFT) runs from sending the request to the first streamed chunk with text. Printed per
conversation and setting: prompt tokens (the gateway's usage) and TTFT of both turns, turn 2's
TTFT over turn 1's (medians of ``--repeats`` conversations of each kind, each with other texts:
no turn 1 finds another's pages); then whether the texts are the same with reuse as without.

Model: the shipped tiny-llama (8 layers, hidden 224; its ``max_position_embeddings`` raised in a
copy where the turns need more than its 1024 positions: rotary positions past it are computed
like any other), or with ``--hidden N`` a random 8-layer llama of width N (N/64 heads) generated
here, with tiny-llama's tokenizer and chat template. ``--dtype``: the peers' and gateways'
compute dtype (and the ``--hidden`` model's stored one).
tests/system/test_bench_smoke.py runs ``--quick``.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench._common import bench_parser
from shardnet.models import default_model_path
from shardnet.testing.helpers import openai_client
from shardnet.testing.localswarm import LocalSwarm

SPANS = [(0, 4), (4, 8)]
TARGET = 0.25
SETTINGS = ("off", "private")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

# -- conversations --------------------------------------------------------------------------------
NOUNS = ("peer", "block", "layer", "cache", "session", "token", "route", "chain", "gateway", "budget", "page",
         "request", "reply", "stream", "claim", "receipt", "witness", "span", "model", "prompt")
VERBS = ("keeps", "sends", "checks", "drops", "opens", "closes", "reads", "writes", "counts", "names")
ADJECTIVES = ("every", "each", "the first", "the last", "a slow", "a busy", "an idle", "a new", "an old")


def sentence(rng: random.Random) -> str:
    return (f"{rng.choice(ADJECTIVES).capitalize()} {rng.choice(NOUNS)} {rng.choice(VERBS)} "
            f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} within {rng.randint(2, 999)} ms.")


def rules(rng: random.Random, n: int) -> str:
    return "\n".join(f"Rule {i + 1}: {sentence(rng)} {sentence(rng)}" for i in range(n))


def document(rng: random.Random, n: int) -> str:
    return "\n\n".join(" ".join(sentence(rng) for _ in range(5)) for _ in range(n))


def code(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        noun, attr = rng.sample(NOUNS, 2)
        limit, low, scale = rng.randint(2, 99), rng.randint(0, 50), rng.randint(2, 9)
        out.append(f"def {rng.choice(VERBS).removesuffix('s')}_{noun}s(items, limit={limit}):\n"
                   f'    """The {attr} of each {noun} above {low}, times {scale}; at most {limit}."""\n'
                   f"    out = []\n    for item in items[:limit]:\n"
                   f"        if item.{attr} > {low}:\n            out.append(item.{attr} * {scale})\n"
                   f"    return out\n")
    return "\n\n".join(out)


@dataclass
class Conversation:
    kind: str
    first: list[dict]  # turn 1's messages
    question: str  # turn 2's new user message


def conversations(count_tokens, tokens: int, seed: int = 35) -> list[Conversation]:
    """The three kinds, each turn 1 grown one unit (a rule, a paragraph, a function) at a time
    until its messages' text reaches ``tokens`` tokens; another ``seed``, other texts."""
    def grown(make) -> list[dict]:
        n = 1
        while True:
            messages = make(random.Random(seed), n)
            if sum(count_tokens(m["content"]) for m in messages) >= tokens:
                return messages
            n += 1

    return [
        Conversation("system prompt", grown(lambda rng, n: [
            {"role": "system", "content": "You answer questions about these rules.\n" + rules(rng, n)},
            {"role": "user", "content": "Which rule covers an idle peer?"}]), "And which one covers a slow chain?"),
        Conversation("document", grown(lambda rng, n: [
            {"role": "user", "content": "Summarise this report:\n\n" + document(rng, n)}]),
            "Now list its three main points."),
        Conversation("code", grown(lambda rng, n: [
            {"role": "user", "content": "Review this Python module:\n\n```python\n" + code(rng, n) + "```"}]),
            "Which function would you test first?"),
    ]


# -- the model ------------------------------------------------------------------------------------
def model_dir(args, workdir: Path, positions: int) -> Path:
    """The checkpoint the swarm serves, with at least ``positions`` positions."""
    if args.hidden:
        from shardnet.inference.model.random_model import init_random

        n = args.hidden
        path = init_random(workdir / f"llama-{n}", "llama", layers=8, hidden=n, heads=n // 64, kv_heads=max(1, n // 256),
                           intermediate=n * 8 // 3 // 64 * 64, vocab=2048, dtype=args.dtype, seed=1)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # every ID a token, and a chat template
            shutil.copy(default_model_path() / name, path / name)
    else:
        path = default_model_path()
    config = json.loads((path / "config.json").read_text())
    if config["max_position_embeddings"] < positions:
        if not args.hidden:  # the shipped files stay as they are
            path = Path(shutil.copytree(path, workdir / path.name))
        config["max_position_embeddings"] = positions
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def kv_budget_mb(path: Path, dtype: str, positions: int, sessions: int) -> int:
    """Room at a block of 4 layers for ``sessions`` sessions of ``positions`` positions each and
    as many sessions' prefix pages (keys, values and the block's output rows), twice over."""
    c = json.loads((path / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_position = (4 * 2 * c["num_key_value_heads"] * head_dim + c["hidden_size"]) * DTYPE_BYTES[dtype]
    return max(64, 2 * 2 * sessions * positions * per_position // 2**20 + 1)


# -- turns ----------------------------------------------------------------------------------------
@dataclass
class Turn:
    ttft: float  # seconds from sending to the first chunk with text
    text: str
    prompt_tokens: int


def no_eos(path: Path) -> dict[str, float]:
    """A logit bias that keeps the end-of-sequence token out, so that every turn answers (a random
    model may well end at once)."""
    eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
    return {str(t): -100 for t in (eos if isinstance(eos, list) else [eos] if eos is not None else [])}


def turn(client, model: str, messages: list[dict], max_tokens: int, bias: dict[str, float] | None = None) -> Turn:
    t0 = time.monotonic()
    ttft, parts, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            logit_bias=bias or {}, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.monotonic() - t0
                parts.append(choice.delta.content)
    if ttft is None or usage is None:
        raise SystemExit(f"error: a turn came back without text or usage ({''.join(parts)!r}, {usage})")
    return Turn(ttft, "".join(parts), usage.prompt_tokens)


def first_reply(client, model: str, bias: dict[str, float], timeout: float = 90.0) -> None:
    """A short chat once the gateway sees the whole model (it warms the connections too)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            turn(client, model, [{"role": "user", "content": "Hello."}], 2, bias)
            return
        except Exception as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"error: the gateway never served a first request ({e})") from None
            time.sleep(1.0)


@dataclass
class Result:
    kind: str
    setting: str
    first: Turn
    second: Turn

    @property
    def ratio(self) -> float:
        return self.second.ttft / self.first.ttft


def run(args, path: Path, workdir: Path, rounds: list[list[Conversation]], budget: int) -> list[Result]:
    results: list[Result] = []
    with LocalSwarm(workdir / "swarm") as swarm:
        swarm.start_bootstrap()
        swarm.join_spans(SPANS, "--model", str(path), "--dtype", args.dtype, "--threads", str(args.threads),
                         "--kv-budget-mb", str(budget), timeout=300)
        serve_args = ("--model", str(path), "--dtype", args.dtype)
        clients, bias = {}, no_eos(path)
        for setting in SETTINGS:
            url, _ = swarm.start_gateway(*serve_args, "--prefix-reuse", setting, timeout=120, name=f"gateway-{setting}")
            clients[setting] = openai_client(url, timeout=600)
        for client in clients.values():
            first_reply(client, path.name, bias)
        for chat in (c for chats in rounds for c in chats):
            for setting, client in clients.items():
                first = turn(client, path.name, chat.first, args.answer_tokens, bias)
                again = [*chat.first, {"role": "assistant", "content": first.text},
                         {"role": "user", "content": chat.question}]
                results.append(Result(chat.kind, setting, first, turn(client, path.name, again, args.answer_tokens, bias)))
                print(f"  ({chat.kind}, {setting}: turn 1 {first.ttft:.3f} s, turn 2 {results[-1].second.ttft:.3f} s)",
                      flush=True)
    return results


def report(args, budget: int, results: list[Result]) -> None:
    name = f"a random 8-layer llama of width {args.hidden}" if args.hidden else "tiny-llama"
    print(f"{name} ({args.dtype}) over 2 peers {SPANS}, {args.threads} torch thread(s) each, KV budget "
          f"{budget} MiB each; two gateways on that swarm: --prefix-reuse off and private")
    print(f"greedy chat turns streamed with the openai client, {args.answer_tokens} new tokens each; "
          f"turn 2 resends turn 1 (about {args.first_turn} tokens), the answer and a new question; "
          f"medians of {args.repeats} conversation(s) of each kind, each with other texts")
    print(f"target: turn-2 TTFT <= {TARGET:g}x turn-1 TTFT with reuse")
    print(f"{'conversation':<14} {'reuse':<8} {'prompt 1':>8} {'TTFT 1 s':>9} {'prompt 2':>8} {'TTFT 2 s':>9} "
          f"{'2 / 1':>7}  target")
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.kind, r.setting), []).append(r)

    def med(rs: list[Result], value) -> float:
        return statistics.median(value(r) for r in rs)

    for (kind, setting), rs in groups.items():
        ratio = med(rs, lambda r: r.ratio)
        verdict = "-" if setting == "off" else "meets" if ratio <= TARGET else "misses"
        print(f"{kind:<14} {setting:<8} {med(rs, lambda r: r.first.prompt_tokens):>8.0f} "
              f"{med(rs, lambda r: r.first.ttft):9.3f} {med(rs, lambda r: r.second.prompt_tokens):>8.0f} "
              f"{med(rs, lambda r: r.second.ttft):9.3f} {ratio:6.2f}x  {verdict}")
    for kind in dict.fromkeys(r.kind for r in results):
        off, on = (groups[kind, s] for s in SETTINGS)
        print(f"{kind}: turn-2 TTFT with reuse {med(on, lambda r: r.second.ttft) / med(off, lambda r: r.second.ttft):.2f}x "
              f"of without; turn-1 texts same with and without reuse: {[a.first.text for a in off] == [b.first.text for b in on]}; "
              f"turn-2 texts same: {[a.second.text for a in off] == [b.second.text for b in on]}")


def main() -> None:
    ap = bench_parser(__doc__, quick="a short run for the tests: tiny-llama, one conversation, a 300-token first turn")
    ap.add_argument("--first-turn", type=int, default=1500, help="tokens of turn 1's messages")
    ap.add_argument("--conversations", type=int, default=3, choices=[1, 2, 3],
                    help="how many of the kinds (system prompt, document, code)")
    ap.add_argument("--answer-tokens", type=int, default=16, help="new tokens per turn")
    ap.add_argument("--hidden", type=int, default=None, metavar="N",
                    help="a random 8-layer llama of width N (generated here) instead of the shipped tiny-llama")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES),
                    help="compute dtype of peers and gateways (and the --hidden model's stored one)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per compute peer")
    ap.add_argument("--repeats", type=int, default=3, help="conversations of each kind (other texts each; medians)")
    args = ap.parse_args()
    if args.quick:
        args.first_turn, args.conversations, args.repeats, args.hidden = 300, 1, 1, None
    with tempfile.TemporaryDirectory(prefix="shardnet-prefix-chat-") as d:
        workdir = Path(d)
        positions = args.first_turn + 4 * args.answer_tokens + 256  # turn 2, with room for the template
        path = model_dir(args, workdir, positions)
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        rounds = [conversations(lambda text: len(tokenizer.encode(text).ids), args.first_turn, seed)[:args.conversations]
                  for seed in range(35, 35 + args.repeats)]
        budget = kv_budget_mb(path, args.dtype, positions, args.conversations * args.repeats + 2)
        results = run(args, path, workdir, rounds, budget)
    report(args, budget, results)


if __name__ == "__main__":
    main()
