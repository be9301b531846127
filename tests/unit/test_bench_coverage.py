"""Every bench script has a smoke test: a bench (a module under bench/ that runs as
``python -m bench.NAME``) is named by one of tests/system/test_bench_*.py, which run it as a
process on a tiny setting (docs/testing.md, "Bench smoke tests"): by its module name
(``"bench.wan_decode"``) or, in test_bench_smoke.py's table, by its path under bench/
(``"wan_decode.py"``). A new bench without one fails here."""

from shardnet.testing.helpers import REPO_ROOT

BENCH = REPO_ROOT / "bench"


def bench_scripts() -> list[str]:
    return sorted(str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text())


def bench_module(script: str) -> str:
    """``swarm_sim/run.py`` -> ``bench.swarm_sim.run``"""
    return "bench." + script.removesuffix(".py").replace("/", ".")


def untested(scripts: list[str], tests: str) -> list[str]:
    return [s for s in scripts if f'"{s}"' not in tests and f'"{bench_module(s)}"' not in tests]


def test_every_bench_has_a_smoke_test():
    tests = "".join(p.read_text() for p in (REPO_ROOT / "tests" / "system").glob("test_bench_*.py"))
    scripts = bench_scripts()
    assert "wan_decode.py" in scripts and "swarm_sim/run.py" in scripts  # the scan finds them
    assert "wan_emulator.py" not in scripts  # a library, no report of its own
    missing = untested(scripts, tests)
    assert not missing, f"benches no tests/system/test_bench_*.py runs: {missing}"


def test_a_bench_without_a_smoke_test_is_caught():
    tests = '{"wan_decode.py": (["--quick"], [])} [sys.executable, "-m", "bench.swarm_sim.run"]'
    assert untested(["new_bench.py", "wan_decode.py", "swarm_sim/run.py"], tests) == ["new_bench.py"]
    assert bench_module("swarm_sim/run.py") == "bench.swarm_sim.run"
