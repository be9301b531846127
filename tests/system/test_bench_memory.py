"""bench/memory.py runs its whole report on a tiny setting (``--quick``): a row per peer and
format, with stored bytes, RSS, peak, the bound and per-token time."""


from shardnet.testing.helpers import bench_stdout


def test_memory_bench_runs_and_prints_its_table():
    out = bench_stdout("bench.memory", "--quick", timeout=300)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("model "))
    rows = [line.split() for line in lines[header + 1:] if line.startswith("llama")]
    assert [(row[1], row[2]) for row in rows] == [(f, s) for f in ("none", "fp8", "int4") for s in ("0:1", "1:2")]
    for row in rows:
        stored, rss, peak, peak_ratio, bound, ms = map(float, [row[3], row[4], row[5], row[6], row[7], row[8]])
        assert 0 < stored < rss <= peak and peak_ratio >= 1.0 and bound > stored and ms > 0, row
        assert row[-1] in ("meets", "misses"), row
    fp8, none = float(rows[2][3]), float(rows[0][3])
    assert fp8 < 0.75 * none  # FP8 weights held at their stored size
    assert "baseline (a peer serving one layer of the shipped tiny model)" in out
