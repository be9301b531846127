"""What every bench shares: its command line's start. A bench is a module run as
``python -m bench.NAME`` from the repository root (so ``bench`` and ``shardnet`` import from this
tree, with no ``sys.path`` edits); ``--quick`` is the tiny setting its smoke test runs
(tests/system/test_bench_*.py). Processes come from shardnet.testing.localswarm, test builders
from shardnet.testing.factories."""

from __future__ import annotations

import argparse


def bench_parser(doc: str, *, quick: str, paragraph: bool = False) -> argparse.ArgumentParser:
    """An argument parser described by the bench's docstring (its first line; ``paragraph``: its
    first paragraph), with ``--quick``: a short run for the tests, ``quick`` saying what it runs."""
    description = doc.split("\n\n")[0] if paragraph else doc.splitlines()[0]
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser
