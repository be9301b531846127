"""Concurrent users through `shardnet serve`: how many requests fail, and how long they take.

    python -m bench.gateway_load [--users 16] [--seconds 30] [--burst N] [--replicas 1] [--chaos] [--quick]
                                 [--before DIR [--after DIR]]

A bootstrap, compute peers of the shipped model (layers 0:4 and 4:8, ``--replicas`` peers each)
and a gateway run as processes on loopback, with default limits. ``--users`` threads each send
greedy completions with the official ``openai`` client (no retries) back to back for
``--seconds``; a request fails when it raises or when its text differs from the text of one
request sent alone first, unless the difference is a *near tie* (``TieCheck``): recomputed here,
every token served is within the peers' dtype's tolerance of its position's best. ``--burst
N``: instead, N requests sent at once. ``--chaos`` (with ``--replicas 2``): replicas die and come
back meanwhile (see ``replica_chaos``). ``--before DIR``: run the same scenario first with the shardnet tree
in DIR (e.g. ``git archive <commit> shardnet | tar -x -C DIR``) and then with this one (or the
one in ``--after DIR``), and print both.
tests/system/test_gateway_load.py drives the helpers here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench._common import bench_parser  # noqa: E402
from shardnet.testing.helpers import openai_client  # noqa: E402
from shardnet.testing.localswarm import LocalSwarm, ShardnetProcess  # noqa: E402

PROMPT = "def main(args):\n    "
#: prompts of different kinds for requests sent at once (tests/system/test_gateway_load.py)
PROMPTS = [PROMPT, "import os\n", "class Parser:\n    def ", "for i in range(", "    return ", "# Copyright",
           "with open(path) as f:\n", "if __name__ == "]
MAX_TOKENS = 12
SPANS = [(0, 4), (4, 8)]


@dataclass
class Load:
    """What the users saw."""

    latencies: list[float] = field(default_factory=list)  # of the requests that succeeded
    errors: collections.Counter = field(default_factory=collections.Counter)  # failure kind -> count
    examples: dict[str, str] = field(default_factory=dict)  # failure kind -> one message
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: texts that differ from the alone text at a near tie (counted among the successes)
    near_ties: int = 0
    tie_example: str = ""

    @property
    def requests(self) -> int:
        return len(self.latencies) + self.failures

    @property
    def failures(self) -> int:
        return sum(self.errors.values())

    def ok(self, seconds: float) -> None:
        with self.lock:
            self.latencies.append(seconds)

    def tied(self, text: str) -> None:
        with self.lock:
            self.near_ties += 1
            self.tie_example = self.tie_example or repr(text)[:300]

    def failed(self, kind: str, message: str) -> None:
        with self.lock:
            self.errors[kind] += 1
            self.examples.setdefault(kind, message[:300])

    def summary(self, label: str = "") -> str:
        p50 = statistics.median(self.latencies) if self.latencies else float("nan")
        rate = 100.0 * self.failures / self.requests if self.requests else 0.0
        kinds = ", ".join(f"{k}: {n}" for k, n in self.errors.most_common()) or "none"
        ties = f", near ties: {self.near_ties}" if self.near_ties else ""
        return (f"{label}requests={self.requests} failures={self.failures} ({rate:.1f} %) "
                f"p50={p50:.2f} s (failures by kind: {kinds}{ties})")


class TieCheck:
    """Whether a text other than the one a prompt gets alone is still one the model gives, up to
    honest rounding. A compute peer batching several sessions' steps rounds them differently from
    a step computed alone (shardnet.inference.model.tolerance): in float16, the shipped model's
    default dtype, two tokens whose logits tie or nearly tie can swap places, and the text goes on
    from the other token. The text is recomputed here, alone, in the peers' dtype, as a walk from
    the prompt: at each position a token may be any within the dtype's tolerance of the best
    (the rule of `shardnet verify --recompute`) whose text continues the served text; the text is
    a near tie when such a walk spells it out whole and ends as it ended (``max_tokens`` tokens
    for finish_reason "length"; for "stop", an end-of-text token within the tolerance next).
    Anything else is a wrong text: another token, a text cut short. (The walk goes by text, not
    by re-encoding it: byte-level BPE merges a prompt's trailing space into the next word.)"""

    #: candidates tried at a position (ties are between two or three tokens), and the most
    #: forward passes one check may take (past that the text counts as wrong)
    BRANCHES = 4
    MAX_PASSES = 256

    def __init__(self, dtype: str = "auto") -> None:
        from shardnet.inference.model.block import Block, dtype_name
        from shardnet.inference.model.local_model import LocalModel
        from shardnet.inference.model.tolerance import logit_tolerance
        from shardnet.models import default_model_path

        self.model = LocalModel(default_model_path(), dtype=dtype)
        self.blocks = [Block(self.model.ckpt, a, b, dtype=self.model.dtype) for a, b in SPANS]
        self.tolerance = logit_tolerance(dtype_name(self.model.dtype))
        self.lock = threading.Lock()

    def _next_logits(self, ids: list[int]):
        import torch

        with self.lock, torch.inference_mode():
            hidden = self.model.head.embed(torch.tensor([ids]))
            for block in self.blocks:
                hidden = block.forward(hidden, block.new_cache(), 0)
            return self.model.head.logits(hidden[:, -1:])[0, -1].float()

    def _within(self, logits) -> list[int]:
        """Tokens within the tolerance of the best, best first."""
        from shardnet.inference.model.tolerance import gaps_to_best

        gaps = gaps_to_best(logits)
        order = gaps.argsort()[:self.BRANCHES]
        return [int(t) for t in order if gaps[t] <= self.tolerance]

    def consistent(self, prompt: str, text: str, finish_reason: str, max_tokens: int) -> bool:
        ids = self.model.encode(prompt)
        passes = 0

        def within_after(out: list[int]) -> list[int]:
            nonlocal passes
            passes += 1
            return [] if passes > self.MAX_PASSES else self._within(self._next_logits(ids + out))

        def walk(out: list[int]) -> bool:
            spelled = self.model.decode(out)
            if spelled == text:
                if finish_reason == "length":
                    return len(out) == max_tokens
                return any(t in self.model.eos_ids for t in within_after(out))
            if len(out) >= max_tokens or not text.startswith(spelled.rstrip("\ufffd")):
                return False
            return any(walk(out + [t]) for t in within_after(out))

        return walk([])


def complete(client, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> str:
    return completion(client, prompt, max_tokens).text


def completion(client, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS):
    """The greedy completion's choice (text and finish_reason)."""
    return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0).choices[0]


def one_request(client, load: Load, expected: str, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS,
                ties: TieCheck | None = None) -> None:
    """One request, counted in ``load``; a text other than ``expected`` fails unless ``ties``
    finds it a near tie."""
    import openai

    t0 = time.monotonic()
    try:
        choice = completion(client, prompt, max_tokens)
        text = choice.text
    except openai.APIStatusError as e:
        load.failed(f"HTTP {e.status_code}", str(e))
        return
    except openai.APIError as e:
        load.failed(type(e).__name__, str(e))
        return
    if text != expected:
        try:
            tied = ties is not None and ties.consistent(prompt, text, choice.finish_reason, max_tokens)
        except Exception as e:  # (counted, not raised: the user's thread goes on)
            load.failed("tie check failed", f"{type(e).__name__}: {e}")
            return
        if not tied:
            load.failed("wrong text", repr(text))
            return
        load.tied(text)
    load.ok(time.monotonic() - t0)


def users(url: str, n: int, seconds: float, expected: str, *, load: Load | None = None,
          ties: TieCheck | None = None) -> Load:
    """``n`` users sending requests back to back until ``seconds`` have passed (each finishes the
    request it has started)."""
    load = load or Load()
    deadline = time.monotonic() + seconds

    def user() -> None:
        client = openai_client(url, timeout=170)
        while time.monotonic() < deadline:
            one_request(client, load, expected, ties=ties)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(user) for _ in range(n)]:
            f.result()
    return load


def burst(url: str, n: int, expected: str, ties: TieCheck | None = None) -> Load:
    """``n`` requests sent at once, one per thread."""
    load = Load()
    start = threading.Barrier(n)

    def one() -> None:
        client = openai_client(url, timeout=170)
        start.wait()
        one_request(client, load, expected, ties=ties)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(one) for _ in range(n)]:
            f.result()
    return load


def replica_chaos(swarm: LocalSwarm, peers, seconds: float, events: list[str]) -> None:
    """A quarter of ``seconds`` in, one replica of the first span is killed (SIGKILL by PID) and
    restarted 5 s later with the same identity; 12 s after it serves again (past one background
    refresh of the gateway's claims) the other replica of that span is killed, so the restarted
    peer is the span's only one. ``events`` gets a line per step."""
    t0 = time.monotonic()
    (a_id, a), (b_id, b) = [(pid, p) for pid, p, span in peers if span == SPANS[0]][:2]
    time.sleep(seconds / 4)
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait(10)
    events.append(f"{time.monotonic() - t0:.0f} s: killed {a_id[:12]} (replica of {SPANS[0][0]}:{SPANS[0][1]})")
    time.sleep(5)
    again = swarm.spawn_node(a.name, "--layers", f"{SPANS[0][0]}:{SPANS[0][1]}", "--threads", "1", command="join")
    if swarm.wait_ready(again, 90)["peer_id"] != a_id:
        raise RuntimeError("the restarted peer has another identity")
    events.append(f"{time.monotonic() - t0:.0f} s: {a_id[:12]} serves again")
    time.sleep(12)
    os.kill(b.pid, signal.SIGKILL)
    b.proc.wait(10)
    events.append(f"{time.monotonic() - t0:.0f} s: killed {b_id[:12]}: {a_id[:12]} is the span's only peer")


def start_replicas(swarm: LocalSwarm, replicas: int, *extra: str) -> list[tuple[str, ShardnetProcess, tuple[int, int]]]:
    """``replicas`` peers per span, loading in parallel: (peer ID, process, span) each."""
    procs = [(swarm.spawn_node(f"p{a}-{i}", "--layers", f"{a}:{b}", "--threads", "1", *extra, command="join"),
              (a, b)) for (a, b) in SPANS for i in range(replicas)]
    return [(swarm.wait_ready(p, 180)["peer_id"], p, span) for p, span in procs]


@contextmanager
def swarm_with_gateway(replicas: int = 1, source: Path | None = None, join_args: tuple[str, ...] = ()):
    """A swarm and its gateway; with ``source``, every process runs the shardnet tree there (the
    children start there too: ``python -m`` puts the working directory first on the path);
    ``join_args``: more arguments for every compute peer (e.g. ``--batch-tokens 256``)."""
    old, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    if source is not None:
        os.environ["PYTHONPATH"] = str(source)
        os.chdir(source)
        used = subprocess.run([sys.executable, "-c", "import shardnet; print(shardnet.__file__)"],
                              capture_output=True, text=True, check=True).stdout.strip()
        if not Path(used).resolve().is_relative_to(source.resolve()):
            raise SystemExit(f"error: processes would run {used}, not the tree in {source}")
    try:
        with LocalSwarm() as swarm:
            swarm.start_bootstrap()
            peers = start_replicas(swarm, replicas, *join_args)
            yield swarm, peers, swarm.start_gateway(timeout=90)[0]
    finally:
        if source is not None:
            os.chdir(cwd)
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old


def scenario(users_n: int, seconds: float, replicas: int, source: Path | None, burst_n: int = 0,
             chaos: bool = False) -> Load:
    ties = TieCheck()
    with swarm_with_gateway(replicas, source) as (swarm, peers, url):
        client = openai_client(url, timeout=170)
        expected = None
        for _ in range(60):  # the first request alone, once the gateway sees the whole model
            try:
                expected = complete(client)
                break
            except Exception:
                time.sleep(1.0)
        if expected is None:
            raise SystemExit("error: the gateway never served a first request")
        if burst_n:
            return burst(url, burst_n, expected, ties)
        if not chaos:
            return users(url, users_n, seconds, expected, ties=ties)
        events: list[str] = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            done = pool.submit(replica_chaos, swarm, peers, seconds, events)
            load = users(url, users_n, seconds, expected, ties=ties)
            done.result()
        for line in events:
            print("  " + line, flush=True)
        return load


def main() -> None:
    ap = bench_parser(__doc__, paragraph=True, quick="a short run for the tests: 2 users x 2 s")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--burst", type=int, default=0, help="send this many requests at once instead")
    ap.add_argument("--replicas", type=int, default=1, help="compute peers per span")
    ap.add_argument("--chaos", action="store_true", help="kill and restart replicas meanwhile (--replicas 2)")
    ap.add_argument("--before", type=Path, default=None, help="a shardnet tree to run first, for comparison")
    ap.add_argument("--after", type=Path, default=None, help="the tree to compare it with (default: this one)")
    args = ap.parse_args()
    if args.quick:
        args.users, args.seconds = 2, 2.0
    if args.chaos and args.replicas < 2:
        ap.error("--chaos needs --replicas 2 (or more)")
    runs = ([("before", args.before.resolve())] if args.before else []) + [
        ("after" if args.before else "this", args.after.resolve() if args.after else None)]
    lines = []
    for label, source in runs:
        load = scenario(args.users, args.seconds, args.replicas, source, args.burst, args.chaos)
        what = f"{args.burst} at once" if args.burst else f"{args.users} users x {args.seconds:g} s"
        what += ", replicas killed and restarted" if args.chaos else ""
        lines.append(load.summary(f"{label}: {what}: "))
        print(lines[-1], flush=True)
        for kind, msg in load.examples.items():
            print(f"  e.g. {kind}: {msg}", flush=True)
        if load.near_ties:
            print(f"  e.g. near tie: {load.tie_example}", flush=True)
    if len(lines) > 1:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
