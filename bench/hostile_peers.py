"""An honest client's latency through a compute peer under attack, side by side in one run.

    python -m bench.hostile_peers [--rounds 9] [--attacks spin,garbage,slowloris,flood,streams] [--quick]

A bootstrap, two compute peers (the shipped model, layers 0:4 and 4:8) and an honest client
(tests/system/doubles/honest_client.py) run as processes; the first compute peer is attacked by one
attacker process at a time (tests/system/doubles/hostile_peer.py, see there for what each attack does;
"spin" is the control, an attacker that only burns CPU). For each attack: ``--rounds`` generations
of 16 tokens right before it starts and as many during it; the ratio of the medians, whether the
tokens changed, whether a new process could still connect (``shardnet ping``), and how much the
victim's memory grew. With two or more CPUs the swarm runs on the first and the attacker on the
last, as on a machine of its own (its connections come from 127.0.0.2). tests/system/test_hostile_peers.py
runs this and asserts the bounds.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent

from bench._common import bench_parser, format_table  # noqa: E402
from shardnet.inference.model.checkpoint import Checkpoint  # noqa: E402
from shardnet.testing.localswarm import LocalSwarm  # noqa: E402
from shardnet.models import default_model_path  # noqa: E402

DOUBLES = ROOT / "tests" / "system" / "doubles"
HOSTILE = [sys.executable, str(DOUBLES / "hostile_peer.py")]
HONEST = [sys.executable, str(DOUBLES / "honest_client.py")]
ATTACKS = ["spin", "garbage", "slowloris", "flood", "streams"]
NEW_TOKENS = 16
RAMP_S = 3.0


@dataclass
class Row:
    attack: str
    before_s: float
    during_s: float
    same_tokens: bool
    new_peer_connects: bool
    rss_growth: int  # bytes, the victim's peak during the attack over its peak before the first
    attacker: str  # the attacker's own counts of requests that went through / were refused

    @property
    def ratio(self) -> float:
        return self.during_s / self.before_s


@contextmanager
def cpus_apart():
    """This process (and so the swarm it starts) on the first CPU; attackers on the last."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        yield
        return
    os.sched_setaffinity(0, {min(before)})
    os.environ["HOSTILE_CPU"] = str(max(before))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        os.environ.pop("HOSTILE_CPU", None)


class Scenario:
    def __init__(self, workdir: Path, rounds: int) -> None:
        self.workdir, self.rounds = workdir, rounds

    def __enter__(self) -> Scenario:
        self.swarm = LocalSwarm(self.workdir).__enter__()
        try:
            boot = self.swarm.start_bootstrap()
            ready = self.swarm.join_spans([(0, 4), (4, 8)], "--threads", "1")
            self.victim = self.swarm.procs[1]  # the first block: every session starts there
            self.target = f"{ready[0]['addrs'][0]}/p2p/{ready[0]['peer_id']}"
            self.model_id = Checkpoint(default_model_path()).model_id
            self.client = self.swarm.spawn_program("honest", HONEST, boot, str(NEW_TOKENS))
            self.client.wait_event(lambda e: e.get("ready"), 180)
            self.rss: list[int] = []
            _, self.tokens = self.timed_rounds()
            self.base_rss = max(self.rss)
        except BaseException:
            self.swarm.stop_all()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.swarm.stop_all()

    def timed_rounds(self) -> tuple[float, list[int]]:
        """Median seconds of ``rounds`` generations, and their tokens (None if they differed)."""
        times, seen = [], []
        for _ in range(self.rounds):
            self.client.proc.stdin.write(b"go\n")
            self.client.proc.stdin.flush()
            ev = self.client.wait_event(lambda e: "s" in e, 180)
            times.append(ev["s"])
            seen.append(ev["ids"])
            self.rss.append(psutil.Process(self.victim.pid).memory_info().rss)
        return statistics.median(times), seen[0] if all(x == seen[0] for x in seen) else None

    def attack(self, name: str) -> Row:
        before, ids_before = self.timed_rounds()
        self.rss.clear()
        hostile = self.swarm.spawn_program(f"hostile-{name}", HOSTILE, name, self.target, self.model_id)
        try:
            hostile.wait_event(lambda e: "attacking" in e, 60)
            time.sleep(RAMP_S)
            during, ids = self.timed_rounds()
            ping = subprocess.run([sys.executable, "-m", "shardnet", "ping", self.target, "--count", "1"],
                                  capture_output=True, text=True, timeout=60)
            counts = hostile.wait_event(lambda e: "ok" in e, 10)
            if not hostile.alive():
                raise RuntimeError(f"the {name} attacker died: {hostile.tail_log()}")
        finally:
            hostile.stop()
        if not self.victim.alive():
            raise RuntimeError(f"the victim died under {name}: {self.victim.tail_log()}")
        same = self.tokens is not None and ids_before == self.tokens and ids == self.tokens
        return Row(name, before, during, same, ping.returncode == 0,
                   max(self.rss) - self.base_rss, f"{counts}")


def table(rows: list[Row]) -> str:
    return format_table(
        ["attack", "before s", "during s", "ratio", "tokens", "new peer", "victim RSS +MiB", "attacker's requests"],
        [[r.attack, f"{r.before_s:.3f}", f"{r.during_s:.3f}", f"{r.ratio:.2f}", "same" if r.same_tokens else "CHANGED",
          "ok" if r.new_peer_connects else "REFUSED", f"{r.rss_growth / 2**20:.1f}", r.attacker] for r in rows],
        notes=True)


def main() -> None:
    ap = bench_parser(__doc__, paragraph=True,
                      quick="a short run for the tests: 1 generation before and during, the control and one attack "
                            "(spin,garbage) unless --attacks says otherwise")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
        if args.attacks == ap.get_default("attacks"):
            args.attacks = "spin,garbage"
    with tempfile.TemporaryDirectory(prefix="shardnet-hostile-") as tmp, cpus_apart(), \
            Scenario(Path(tmp), args.rounds) as scenario:
        rows = []
        for name in args.attacks.split(","):
            rows.append(scenario.attack(name))
            print(f"{name}: {rows[-1].ratio:.2f}x", file=sys.stderr, flush=True)
    print(f"{NEW_TOKENS} tokens per generation, medians of {args.rounds} generations before and during each attack:")
    print(table(rows))


if __name__ == "__main__":
    main()
