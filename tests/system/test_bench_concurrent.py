"""bench/concurrent_decode.py runs: batched and one-at-a-time rows on loopback and through the
emulated WAN (``--quick``), and at a context (``--context``: long prompts, the decode phase after
every session's prefill), each with its figures, ratios to its own 1-session row, the time until
every session's first token, and the batches' size (at the peers, and of the client's LM head)."""

import subprocess
import sys

import pytest

from shardnet.testing.helpers import REPO_ROOT

COLUMNS = ("network", "mode", "sessions", "agg", "agg_x1", "ms", "ms_x1", "p50", "p95", "prefill", "batch", "head",
           "cpu", "cores", "split")


def run_concurrent_bench(*args: str) -> tuple[str, list[dict]]:
    """The bench's report and its table's rows (a dict per row, by COLUMNS, and "target")."""
    r = subprocess.run([sys.executable, "-m", "bench.concurrent_decode", *args],
                       capture_output=True, text=True, timeout=180, check=False, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("network"))
    rows = []
    for line in lines[header + 1:]:
        if not line.startswith(("loopback", "wan")):
            break
        cells = line.split(maxsplit=len(COLUMNS))
        rows.append({**dict(zip(COLUMNS, cells)), "target": cells[len(COLUMNS)]})
    assert any(line.startswith("greedy output differs batched vs one-at-a-time in ") for line in lines), r.stdout
    return r.stdout, rows


def check_rows(rows: list[dict]) -> None:
    for row in rows:
        assert float(row["agg"]) > 0 and float(row["ms"]) > 0 and float(row["p95"]) >= float(row["p50"]) > 0, row
        assert float(row["prefill"]) > 0, row  # until every session had its first token
        if row["sessions"] == "1":  # the ratios are to this row
            assert row["agg_x1"] == row["ms_x1"] == "1.00x", row
        assert float(row["head"]) >= 1.0, row  # sessions per LM head computation in the client
        assert float(row["cpu"]) > 0 and float(row["cores"]) > 0, row  # CPU ms per token, cores busy
        split = [float(x) for x in row["split"].split("/")]  # the client's cores busy, then each peer's
        assert len(split) == 3 and sum(split) == pytest.approx(float(row["cores"]), abs=0.02), row
        assert row["target"] == "-", row  # no row of 16 sessions: no target to meet
        if row["mode"] == "batched":
            assert [float(x) >= 1.0 for x in row["batch"].split("/")] == [True, True], row  # one mean per peer
        else:
            assert row["batch"] == "-", row  # --batch-tokens 0: no batches to count
    # 4 concurrent sessions through a batching chain: some steps ran together
    assert any(float(x) > 1.0 for row in rows if (row["mode"], row["sessions"]) == ("batched", "4")
               for x in row["batch"].split("/")), rows


def test_concurrent_decode_bench_runs_and_prints_its_table():
    out, rows = run_concurrent_bench("--quick")
    assert [(row["network"], row["mode"], row["sessions"]) for row in rows] == [
        (net, mode, n) for net in ("loopback", "wan") for mode in ("batched", "one-at-a-time") for n in ("1", "4")
    ], out
    check_rows(rows)
    assert "wan: 5 ms one way" in out


def test_concurrent_decode_bench_at_a_context():
    out, rows = run_concurrent_bench("--context", "128", "--sessions", "1,4", "--wan-sessions", "", "--tokens", "4")
    assert [(row["network"], row["mode"], row["sessions"]) for row in rows] == [
        ("loopback", mode, n) for mode in ("batched", "one-at-a-time") for n in ("1", "4")
    ], out
    check_rows(rows)
    assert "prompts of 128 tokens" in out and "the figures cover that decode phase (3 tokens a session)" in out
    assert "target: 16 sessions >= 4x the aggregate tok/s of 1;" in out
