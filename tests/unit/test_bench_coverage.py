"""Every bench script has a smoke test: a bench (a file under bench/ that runs as a script) is
named, as ``"<path under bench/>"``, by one of tests/system/test_bench_*.py, which run it as a
process on a tiny setting (docs/testing.md, "Bench smoke tests"). A new bench without one fails
here."""

from shardnet.testing.helpers import REPO_ROOT

BENCH = REPO_ROOT / "bench"


def bench_scripts() -> list[str]:
    return sorted(str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text())


def untested(scripts: list[str], tests: str) -> list[str]:
    return [s for s in scripts if f'"{s}"' not in tests]


def test_every_bench_has_a_smoke_test():
    tests = "".join(p.read_text() for p in (REPO_ROOT / "tests" / "system").glob("test_bench_*.py"))
    scripts = bench_scripts()
    assert "wan_decode.py" in scripts and "swarm_sim/run.py" in scripts  # the scan finds them
    assert "wan_emulator.py" not in scripts  # a library, no report of its own
    missing = untested(scripts, tests)
    assert not missing, f"benches no tests/system/test_bench_*.py runs: {missing}"


def test_a_bench_without_a_smoke_test_is_caught():
    tests = '{"wan_decode.py": (["--quick"], [])}'
    assert untested(["new_bench.py", "wan_decode.py"], tests) == ["new_bench.py"]
