"""bench/families.py runs (tiny sizes): every row says the chain matched transformers."""

from shardnet.testing.helpers import REPO_ROOT


def test_families_bench_runs_and_matches():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "bench.families", "--hidden", "32", "--tokens", "4",
                        "--families", "gemma2,deepseek_v3"], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["gemma2", "deepseek_v3"]
    assert all(row[-1] == "yes" for row in rows), r.stdout
