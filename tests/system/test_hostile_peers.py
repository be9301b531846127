"""Hostile peers as real processes against a compute peer, each attack in turn: garbage after
the handshake, slowloris, a gossip and DHT flood, thousands of streams (and "spin", a control
that only burns CPU). The victim must stay responsive: an honest client's generation through it
takes at most RATIO_BOUND times as long as without the attack (the medians of ROUNDS generations
right before the attack and ROUNDS during it, so drift on a noisy machine does not count), gives
the same tokens, a new peer can still connect, and the victim's memory grows by at most
MEMORY_BOUND. The scenario is bench/hostile_peers.py's (see there); attackers run on a CPU of
their own, as on machines of their own."""

import sys
from pathlib import Path

import pytest

from bench.hostile_peers import ATTACKS, Scenario, cpus_apart, table  # noqa: E402

pytestmark = pytest.mark.slow

ROUNDS = 5
RATIO_BOUND = 2.0
MEMORY_BOUND = 256 << 20


def test_a_compute_peer_stays_responsive_under_attack(tmp_path):
    rows = []
    with cpus_apart(), Scenario(tmp_path, ROUNDS) as scenario:
        for attack in ATTACKS:
            # a noisy machine may slow one measurement: an attack over the bound is measured once
            # more, and the better of the two stands (a real regression fails both)
            row = scenario.attack(attack)
            if row.ratio > RATIO_BOUND:
                print(f"{attack}: {row.ratio:.2f}x, measuring again")
                row = min(row, scenario.attack(attack), key=lambda r: r.ratio)
            rows.append(row)
            assert row.same_tokens, attack
            assert row.new_peer_connects, attack
    print()
    print("\n" + table(rows))
    for row in rows:
        assert row.ratio <= RATIO_BOUND, table(rows)
        assert row.rss_growth <= MEMORY_BOUND, table(rows)
