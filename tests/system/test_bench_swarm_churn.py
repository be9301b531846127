"""bench/swarm_churn.py's whole report, run as CI's check of a larger swarm under churn (issue
37): 12 `shardnet join --max-layers 2` processes are all visible to `shardnet status`, generate
what transformers generates, and after a third of them are killed at once (every peer of layer 0
among them) cover every layer again and generate the same text. Bounds are looser than the
issue's 60 s targets (which the bench's 24-peer run is measured against, docs/benchmarks.md):
CI's machine runs 13 processes on 2 cores."""

import json

import pytest

from shardnet.testing.helpers import bench_stdout

pytestmark = pytest.mark.slow

BOUND_S = 90.0


def test_twelve_peers_are_visible_generate_and_recover_from_losing_a_third(tmp_path):
    out = tmp_path / "churn.json"
    stdout = bench_stdout("bench.swarm_churn", "--peers", "12", "--kill", "4", "--timeout", "240", "--generations", "2",
                          "--json", str(out), timeout=1200)
    print(stdout)
    c = json.loads(out.read_text())
    assert "all peers visible" in stdout and "output equal to transformers again" in stdout
    assert c["visible_s"] is not None and c["visible_s"] <= BOUND_S, c
    assert c["output_equal"], c
    assert c["killed_layer0"] >= 1 and c["covered_again_s"] is not None and c["covered_again_s"] <= BOUND_S, c
    assert c["output_equal_after"] and c["output_again_s"] <= BOUND_S + 30, c
