"""bench/weights_fetch.py --quick runs: both tables, every row with its figures."""

import subprocess
import sys

from shardnet.testing.helpers import REPO_ROOT


def test_weights_fetch_bench_runs_and_prints_its_tables(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.weights_fetch", "--quick",
                        "--join-root", str(tmp_path)], capture_output=True, text=True, timeout=240, check=False,
                       cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("sources"))
    rows = [line.split() for line in lines[header + 1:header + 5]]
    assert [row[0] for row in rows] == ["1", "2", "4", "1"], r.stdout
    assert rows[0][-3:-1] == ["1.00", "100"], r.stdout  # the ratios are to this row
    assert "no cap" in lines[header + 4] and "emulates a home uplink" in r.stdout
    for row in rows:
        assert float(row[-3]) > 0, r.stdout  # MB/s
    assert len(rows[2][-2].split("/")) == 4, r.stdout  # four sources, each sent a share
    assert "shardnet model manifest, no cache" in r.stdout
    serving = next(line for line in lines if line.startswith("joiner: start to serving"))
    assert float(serving.split()[-2]) > 0, r.stdout
    fetched = next(line for line in lines if line.startswith("joiner: bytes fetched (files"))
    assert float(fetched.split()[-2]) > 1.0, r.stdout  # MB: half the layers came over the swarm
