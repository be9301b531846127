"""Coverage-guided fuzzing of shardnet's wire decoders with atheris (libFuzzer for Python).

    python fuzz/run.py                       # every target, until stopped (Ctrl-C)
    python fuzz/run.py nat.relay_hop --seconds 300
    python fuzz/run.py all --runs 20000      # what tests/system/test_fuzz_targets.py runs

A crash is an untyped exception escaping a decoder: libFuzzer prints the input and writes it to
``crash-<sha1>`` in the current directory; reproduce with ``python fuzz/run.py TARGET crash-...``
(the file is run once). Targets: fuzz/targets.py. Needs ``pip install atheris`` (in the test extras).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", nargs="?", default="all", help="a name from fuzz/targets.py, or all")
    ap.add_argument("inputs", nargs="*", help="files to run once each (reproducing a crash)")
    ap.add_argument("--runs", type=int, default=None, help="stop after this many inputs")
    ap.add_argument("--seconds", type=int, default=None, help="stop after this long")
    args = ap.parse_args()
    try:
        import atheris
    except ImportError:
        print("fuzz/run.py: atheris is not installed (pip install atheris)", file=sys.stderr)
        return 2
    # atheris 2.3.0's bytecode instrumentation breaks FrameDecoder.feed on Python 3.11 (under it,
    # ``self`` turns into an int: "'int' object has no attribute '_need'"; uninstrumented, the same
    # input decodes): that module runs uninstrumented, its bytes still fuzzed through every target
    with atheris.instrument_imports(include=["shardnet"], exclude=["shardnet.protocols.framing"]):
        from fuzz.targets import TARGETS, check
    names = sorted(TARGETS) if args.target == "all" else [args.target]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        print(f"fuzz/run.py: unknown target {unknown[0]} (choose from {', '.join(sorted(TARGETS))})", file=sys.stderr)
        return 2

    def one_input(data: bytes) -> None:
        # with several targets, the first byte picks one: the corpus stays shared
        if len(names) == 1:
            check(names[0], data)
        elif data:
            check(names[data[0] % len(names)], data[1:])

    with tempfile.TemporaryDirectory(prefix="shardnet-fuzz-") as corpus:
        for i, name in enumerate(names):
            for j, seed in enumerate(TARGETS[name].seeds):
                prefix = b"" if len(names) == 1 else bytes([i])
                (Path(corpus) / f"{name}-{j}").write_bytes(prefix + seed)
        argv = [sys.argv[0], *(args.inputs or [corpus])]
        if args.runs is not None:
            argv.append(f"-runs={args.runs}")
        if args.seconds is not None:
            argv.append(f"-max_total_time={args.seconds}")
        atheris.Setup(argv, one_input)
        atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
