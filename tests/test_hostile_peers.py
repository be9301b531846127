"""Hostile peers as real processes against a compute peer, each attack in turn: garbage after
the handshake, slowloris, a gossip and DHT flood, thousands of streams. The victim must stay
responsive: an honest client's generation through it takes at most RATIO_BOUND times as long as
without the attack (the median of ROUNDS generations right before the attack starts and of ROUNDS
during it, so drift on a noisy machine does not count), gives the same tokens, a new peer can
still connect, and the victim's memory stays within MEMORY_BOUND of what it used before the
first attack.

An attacker stands in for a machine of its own: with two or more CPUs, the swarm (this process
and its children) runs on the first CPU and the attacker on the last, so what is measured is
the victim's cost of handling the attack's traffic, not CPU the attacking program takes from the
swarm. "spin", the control, is an attacker that only burns CPU: it should cost nothing."""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from shardnet.localswarm import LocalSwarm

pytestmark = pytest.mark.slow

DOUBLES = Path(__file__).parent / "doubles"
HOSTILE = [sys.executable, str(DOUBLES / "hostile_peer.py")]
HONEST = [sys.executable, str(DOUBLES / "honest_client.py")]
#: "spin" is the control: an attacker process that only burns CPU, sending nothing
ATTACKS = ["spin", "garbage", "slowloris", "flood", "streams"]
ROUNDS = 9
NEW_TOKENS = 16
RATIO_BOUND = 2.0
MEMORY_BOUND = 256 << 20
RAMP_S = 3.0


def timed_rounds(client, victim, rss):
    times, ids = [], None
    for _ in range(ROUNDS):
        client.proc.stdin.write(b"go\n")
        client.proc.stdin.flush()
        ev = client.wait_event(lambda e: "s" in e, 180)
        times.append(ev["s"])
        assert ids is None or ev["ids"] == ids
        ids = ev["ids"]
        rss.append(psutil.Process(victim.pid).memory_info().rss)
    return statistics.median(times), ids


@pytest.fixture
def cpus_apart():
    """The swarm on CPU 0, attackers on the last CPU (restored afterwards)."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        yield {}
        return
    os.sched_setaffinity(0, {min(before)})
    try:
        yield {"HOSTILE_CPU": str(max(before))}
    finally:
        os.sched_setaffinity(0, before)


def measure(swarm, client, victim, target, model_id, attack, rss, base_rss, want_ids):
    base_s, ids = timed_rounds(client, victim, rss)
    assert ids == want_ids
    rss.clear()
    hostile = swarm.spawn_program(f"hostile-{attack}", HOSTILE, attack, target, model_id)
    hostile.wait_event(lambda e: "attacking" in e, 60)
    time.sleep(RAMP_S)
    s, ids = timed_rounds(client, victim, rss)
    ping = subprocess.run([sys.executable, "-m", "shardnet", "ping", target, "--count", "1"],
                          capture_output=True, text=True, timeout=60)
    counts = hostile.wait_event(lambda e: "ok" in e, 10)
    assert hostile.alive(), hostile.tail_log()
    hostile.stop()
    assert victim.alive(), victim.tail_log()
    print(f"{attack}: median {s:.3f} s against {base_s:.3f} s ({s / base_s:.2f}x), attacker {counts}", flush=True)
    assert ids == want_ids, attack
    assert ping.returncode == 0, (attack, ping.stderr[-500:])
    return attack, base_s, s, s / base_s, f"{counts}", max(rss) - base_rss


def test_a_compute_peer_stays_responsive_under_attack(tmp_path, cpus_apart, monkeypatch):
    for k, v in cpus_apart.items():
        monkeypatch.setenv(k, v)
    with LocalSwarm(tmp_path) as swarm:
        boot = swarm.start_bootstrap()
        ready = swarm.join_spans([(0, 4), (4, 8)], "--threads", "1")
        victim = swarm.procs[1]  # the first block: every session starts there
        target = f"{ready[0]['addrs'][0]}/p2p/{ready[0]['peer_id']}"
        from shardnet.inference.checkpoint import Checkpoint
        from shardnet.models import default_model_path

        model_id = Checkpoint(default_model_path()).model_id
        client = swarm.spawn_program("honest", HONEST, boot, str(NEW_TOKENS))
        client.wait_event(lambda e: e.get("ready"), 180)

        rss: list[int] = []
        _, want_ids = timed_rounds(client, victim, rss)
        base_rss = max(rss)
        rows = []
        for attack in ATTACKS:
            # a noisy machine may slow one measurement: an attack over the bound is measured once
            # more, and the better of the two stands (a real regression fails both)
            for attempt in range(2):
                row = measure(swarm, client, victim, target, model_id, attack, rss, base_rss, want_ids)
                if row[3] <= RATIO_BOUND:
                    break
            rows.append(row)
        print()
        print(f"{'attack':<10} {'before s':>9} {'during s':>9} {'ratio':>6} {'victim RSS +MiB':>16}  attacker's requests")
        for attack, before, during, ratio, counts, grown in rows:
            print(f"{attack:<10} {before:>9.3f} {during:>9.3f} {ratio:>6.2f} {grown / 2**20:>16.1f}  {counts}")
        for attack, before, during, ratio, counts, grown in rows:
            assert ratio <= RATIO_BOUND, rows
            assert grown <= MEMORY_BOUND, rows
