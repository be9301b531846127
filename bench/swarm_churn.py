"""A swarm of many real processes under churn (issue 37): visibility, generation and recovery.

    python -m bench.swarm_churn [--peers 24] [--kill 8] [--max-layers 2] [--tokens 12]
                                [--generations 5] [--timeout 300] [--json PATH] [--quick]

On loopback, serving the shipped tiny-llama (8 layers), all from this machine:

1. The baseline: a bootstrap and 2 ``shardnet join --layers`` peers (0:4, 4:8); a greedy
   ``shardnet generate`` of ``--tokens`` tokens through them, its time (prefill + decode, from the
   command's own report; the process's start is not counted): the median of ``--generations``
   after one that warms the peers (one generation takes a tenth of a second here, so one or two
   were as noisy as the 2x target is wide).
2. The swarm: a new bootstrap and ``--peers`` ``shardnet join --max-layers N`` processes, started
   at once, choosing their layers; when each was started and when it joined (its ``serving``
   event: loaded, first claim as a server out); from the last join (the issue's measure) and
   from the last process's start, how long until a fresh node (``shardnet status --json``, a
   new process each look, each look's time and findings kept) lists every peer live and every
   layer served; then the same generation, its time against the baseline's, its text against
   single-process transformers.
3. ``--kill`` peers killed at once with SIGKILL by PID, every peer serving layer 0 among them (the
   rest picked in start order); how long until ``shardnet status`` sees every layer served again,
   and until a generation's text equals transformers' again.

The issue's targets (24 peers): visible within 60 s of the last join; generation within 2x the
2-peer time; after killing 8, coverage and identical output within 60 s. ``--quick`` runs 6
peers and kills 2. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._common import bench_parser, print_table, ratio
from shardnet.models import default_model_path
from shardnet.testing.localswarm import LocalSwarm, shardnet_argv

PROMPT = "def fib(n):"
STATUS_EVERY_S = 2.0


@dataclass
class Look:
    """One ``shardnet status`` look after the last peer joined."""

    at_s: float  # when it began, after the last peer's ``serving``
    took_s: float  # the whole process, start to exit
    listed: int  # live peers it listed
    unanswered: int  # claims it found whose peers did not answer its ping (3 s)
    complete: bool  # every layer served


@dataclass
class Churn:
    peers: int
    killed: int
    generations: int  # timed generations per swarm (their median is the figure)
    baseline_gen_s: float
    joined_s: float  # from the last process's start to the last peer's ``serving`` (all joined)
    #: from the last ``serving`` to the end of the first look listing every peer (None: not within the timeout)
    visible_s: float | None
    visible_after_spawn_s: float | None  # the same from the last process's start
    visible_most: int  # the most live peers any look listed
    looks: list[Look]
    gen_s: float
    output_equal: bool
    killed_layer0: int  # how many of the killed served layer 0 (all that did)
    covered_again_s: float | None
    output_again_s: float | None
    output_equal_after: bool
    chosen: list[list[int]]  # the spans the peers chose, as they joined
    spans: list[list[int]]  # the spans when all were visible (after any moves)


def status(swarm: LocalSwarm) -> dict:
    """``shardnet status --json``'s swarm, from a fresh process (a new node each time)."""
    r = subprocess.run(shardnet_argv("status", "--bootstrap", swarm.bootstrap_addr, "--wait", "5", "--json"),
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"shardnet status failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)["swarm"]


def generation(swarm: LocalSwarm, tokens: int) -> tuple[str, float]:
    """A greedy generation's text and its time (prefill + decode, from its own report)."""
    r = subprocess.run(shardnet_argv("generate", "--bootstrap", swarm.bootstrap_addr, "-n", str(tokens), PROMPT),
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"shardnet generate failed: {r.stderr.strip()[-500:]}")
    text, _, report = r.stdout.partition("\n-- ")
    m = re.search(r"(\d+) tokens, ([0-9.]+) tok/s decode, prefill (\d+) ms", report)
    if m is None:
        raise RuntimeError(f"no timing in generate's report: {report[:300]!r}")
    n, rate, prefill_ms = int(m[1]), float(m[2]), int(m[3])
    return text, prefill_ms / 1000 + (n / rate if rate else 0.0)


def timed_generations(swarm: LocalSwarm, tokens: int, n: int) -> tuple[list[str], float]:
    """``n`` generations after one that warms the peers' caches: their texts and median time."""
    generation(swarm, tokens)
    runs = [generation(swarm, tokens) for _ in range(n)]
    return [t for t, _ in runs], statistics.median(s for _, s in runs)


def expected_text(tokens: int) -> str:
    from tokenizers import Tokenizer

    from shardnet.testing.helpers import transformers_greedy

    model = default_model_path()
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return tok.decode(tok.encode(PROMPT).ids + transformers_greedy(model, PROMPT, tokens))


def baseline(tokens: int, generations: int) -> float:
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        swarm.join_spans([(0, 4), (4, 8)], "--threads", "1", "--throughput", "100")
        return timed_generations(swarm, tokens, generations)[1]


def run(peers: int, kill: int, *, max_layers: int = 2, tokens: int = 12, generations: int = 5,
        timeout: float = 300.0, progress=print) -> Churn:
    want = expected_text(tokens)
    base = baseline(tokens, generations)
    progress(f"2-peer baseline: {base:.2f} s for {tokens} tokens (median of {generations})")
    with LocalSwarm() as swarm:
        swarm.start_bootstrap()
        procs = [swarm.spawn_node(f"p{i}", "--threads", "1", "--throughput", "100", "--max-layers", str(max_layers),
                                  command="join") for i in range(peers)]
        last_spawn = procs[-1].started
        by_id, ready_at, chosen = {}, [], []
        for p in procs:
            # joined: its ``serving`` event, once its first claim as a server is out (stamped as
            # it came, however late it is read here)
            chosen.append(p.wait_event(lambda e: e.get("event") == "serving", timeout)["layers"])
            ready_at.append(p.line_at)
            by_id[swarm.wait_ready(p, 60)["peer_id"]] = p
        last_ready = max(ready_at)
        progress(f"{peers} peers serving, the last {last_ready - last_spawn:.1f} s after the last spawn "
                 f"(each {min(r - p.started for r, p in zip(ready_at, procs)):.1f}-"
                 f"{max(r - p.started for r, p in zip(ready_at, procs)):.1f} s); looking with `shardnet status`")
        visible_at, most, sw, looks = None, 0, {}, []
        while time.monotonic() - last_ready < timeout:
            began = time.monotonic()
            sw = status(swarm)
            ended = time.monotonic()
            most = max(most, len(sw["peers"]))
            looks.append(Look(round(began - last_ready, 1), round(ended - began, 1), len(sw["peers"]),
                              len(sw["unreachable_claims"]), sw["complete"]))
            progress(f"look: {looks[-1]}")
            if len(sw["peers"]) == peers and sw["complete"]:
                visible_at = ended
                break
            time.sleep(STATUS_EVERY_S)
        spans = {p["peer_id"]: tuple(p["layers"]) for p in sw.get("peers", [])}
        progress(f"visible: {most}/{peers} after {time.monotonic() - last_ready:.1f} s")
        texts, gen_s = timed_generations(swarm, tokens, generations)
        equal = all(t == want for t in texts)

        first = [pid for pid in by_id if spans.get(pid, (1,))[0] == 0]
        victims = (first + [pid for pid in by_id if pid not in first])[:kill]
        for pid in victims:
            os.kill(by_id[pid].pid, signal.SIGKILL)
        for pid in victims:
            by_id.pop(pid).proc.wait(10)
        killed = time.monotonic()
        progress(f"killed {kill} ({sum(v in first for v in victims)} of them served layer 0)")
        covered_s = output_s = None
        equal_after = False
        while time.monotonic() - killed < timeout:
            sw = status(swarm)
            if sw["complete"]:
                covered_s = covered_s or time.monotonic() - killed
                try:
                    equal_after = generation(swarm, tokens)[0] == want
                except RuntimeError as e:
                    progress(f"generation after the kill failed: {e}")
                if equal_after:
                    output_s = time.monotonic() - killed
                    break
            time.sleep(STATUS_EVERY_S)
        return Churn(peers, kill, generations, base, round(last_ready - last_spawn, 1),
                     None if visible_at is None else round(visible_at - last_ready, 1),
                     None if visible_at is None else round(visible_at - last_spawn, 1), most, looks, gen_s, equal,
                     sum(v in first for v in victims), covered_s, output_s, equal_after, sorted(chosen),
                     sorted(list(s) for s in spans.values()))


def report(c: Churn) -> None:
    def s(x):
        return "never" if x is None else f"{x:.1f} s"

    def counts(spans):
        return ", ".join(f"{n} on {a}:{b}" for (a, b), n in sorted(Counter(map(tuple, spans)).items()))

    print_table(f"A swarm of {c.peers} `shardnet join --max-layers` processes on this machine, "
                f"{c.killed} killed at once (spans chosen: {counts(c.chosen)}; when all were visible: "
                f"{counts(c.spans)})",
                ["measure", "figure", "target"], [
                    ["all peers joined (`serving`), from the last process's start", f"{c.joined_s:.1f} s", ""],
                    ["all peers visible to `shardnet status`, from the last join",
                     f"{s(c.visible_s)} ({c.visible_most}/{c.peers}, {len(c.looks)} looks)", "<= 60 s"],
                    ["the same, from the last process's start", s(c.visible_after_spawn_s), ""],
                    [f"generation, 2-peer swarm (median of {c.generations})", f"{c.baseline_gen_s:.2f} s", ""],
                    [f"generation, {c.peers}-peer swarm", f"{c.gen_s:.2f} s ({ratio(c.gen_s, c.baseline_gen_s)})",
                     "<= 2x the 2-peer time"],
                    ["output equals transformers", "yes" if c.output_equal else "NO", ""],
                    [f"every layer served again after the kill ({c.killed_layer0} served layer 0)",
                     s(c.covered_again_s), "<= 60 s"],
                    ["output equal to transformers again", s(c.output_again_s), "<= 60 s"],
                ], notes=True)


def main() -> None:
    parser = bench_parser(__doc__, quick="6 peers, 2 killed")
    parser.add_argument("--peers", type=int, default=24)
    parser.add_argument("--kill", type=int, default=8)
    parser.add_argument("--max-layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--generations", type=int, default=5, help="timed generations per swarm (median)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    a = parser.parse_args()
    if a.quick:
        a.peers, a.kill = 6, 2
    if a.generations < 1:
        parser.error("--generations must be at least 1")
    c = run(a.peers, a.kill, max_layers=a.max_layers, tokens=a.tokens, generations=a.generations, timeout=a.timeout,
            progress=lambda m: print(m, file=sys.stderr, flush=True))
    report(c)
    if a.json:
        a.json.write_text(json.dumps(asdict(c)))


if __name__ == "__main__":
    main()
