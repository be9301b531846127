"""bench/concurrent_decode.py --quick runs: batched and one-at-a-time rows on loopback and through
the emulated WAN, each with its figures, ratios to its own 1-session row, and the batches' size
(at the peers, and of the client's LM head)."""

import subprocess
import sys

from shardnet.testing.helpers import REPO_ROOT


def test_concurrent_decode_bench_runs_and_prints_its_table():
    r = subprocess.run([sys.executable, "-m", "bench.concurrent_decode", "--quick"],
                       capture_output=True, text=True, timeout=180, check=False, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("network"))
    rows = [line.split() for line in lines[header + 1:header + 9]]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (net, mode, n) for net in ("loopback", "wan") for mode in ("batched", "one-at-a-time") for n in ("1", "4")
    ], r.stdout
    for row in rows:
        agg, agg_ratio, ms, ms_ratio, p50, p95 = row[3:9]
        assert float(agg) > 0 and float(ms) > 0 and float(p95) >= float(p50) > 0, row
        if row[2] == "1":  # the ratios are to this row
            assert agg_ratio == ms_ratio == "1.00x", row
        assert float(row[10]) >= 1.0, row  # sessions per LM head computation in the client
        assert float(row[11]) > 0 and float(row[12]) > 0, row  # CPU ms per token, cores busy
        assert row[-1] == "-", row  # no row of 16 sessions: no target to meet
        if row[1] == "batched":
            assert [float(x) >= 1.0 for x in row[9].split("/")] == [True, True], row  # one mean per peer
        else:
            assert row[9] == "-", row  # --batch-tokens 0: no batches to count
    # 4 concurrent sessions through a batching chain: some steps ran together
    assert any(float(x) > 1.0 for row in rows if row[1:3] == ["batched", "4"] for x in row[9].split("/")), r.stdout
    assert any(line.startswith("greedy output differs batched vs one-at-a-time in ") for line in lines), r.stdout
    assert "wan: 5 ms one way" in r.stdout
