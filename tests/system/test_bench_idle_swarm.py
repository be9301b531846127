"""bench/idle_swarm.py runs its whole report on a tiny setting (``--quick``: swarms of 2 and 3
``shardnet join`` processes, a 5 s window, one peer of each profiled): a row per size with every
peer visible, the CPU figures, the profile's categories (their shares adding up to 100) and the
message rates from its call counts. The figures themselves are not checked."""

import re

import pytest

from shardnet.testing.helpers import bench_stdout

NUM = r"-?[\d.]+"


@pytest.mark.slow
def test_idle_swarm_bench_runs_and_prints_its_tables():
    out = bench_stdout("bench.idle_swarm", "--quick", timeout=300)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("peers visible"))
    for n, line in zip((2, 3), lines[header + 1:header + 3]):
        # peers, visible, after s, looks, measured, cpu mean/max %, ratio, bootstrap %, rss mean/max,
        # machine cores, load 1m, profiled %
        assert re.match(rf"^{n} +{n}/{n} +{NUM} +\d+ +{n - 1} +{NUM} +{NUM} +{NUM}x +{NUM} +{NUM} +{NUM} +{NUM} "
                        rf"+{NUM}/{NUM} +{NUM}$", line), line
    start = next(i for i, line in enumerate(lines) if line.startswith("category "))
    assert lines[start].split() == ["category", "2:", "%", "2:", "ms/s", "3:", "%", "3:", "ms/s"]
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("what drives them"):
            break
        name, *figures = line.rsplit(maxsplit=4)  # the name, then % and ms/s at each of the 2 sizes
        rows[name.strip()] = [float(x) for x in figures]
    assert rows["total"][0] == rows["total"][2] == 100.0
    shares = [v for k, v in rows.items() if k != "total"]
    assert sum(v[0] for v in shares) == pytest.approx(100.0, abs=1.0)
    assert "trio event loop" in rows and "connections (TCP, Noise, Yamux, multistream)" in rows, rows
    assert all(v[1] >= 0 for v in shares), rows
    drives = next(i for i, line in enumerate(lines) if line.startswith("what drives them"))
    assert lines[drives + 1].split()[-2:] == ["3", "peers"]
    assert re.match(rf"^DHT requests answered \(inbound streams\) +{NUM} +{NUM}$", lines[drives + 2])
    rates = lines.index("messages at the profiled peer, per second (from the profile's call counts)")
    for what in ("pubsub RPCs read", "gossip msgs received", "new claims validated", "ed25519 verifies",
                 "DHT queries sent", "socket reads"):
        assert any(re.match(rf"^{what} +{NUM} +{NUM}$", line) for line in lines[rates:]), (what, out)
