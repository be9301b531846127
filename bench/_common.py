"""What every bench shares: its command line's start and its report's tables. A bench is a module run as
``python -m bench.NAME`` from the repository root (so ``bench`` and ``shardnet`` import from this
tree, with no ``sys.path`` edits); ``--quick`` is the tiny setting its smoke test runs
(tests/system/test_bench_*.py). Processes come from shardnet.testing.localswarm, test builders
from shardnet.testing.factories."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path


def bench_parser(doc: str, *, quick: str, paragraph: bool = False) -> argparse.ArgumentParser:
    """An argument parser described by the bench's docstring (its first line; ``paragraph``: its
    first paragraph), with ``--quick``: a short run for the tests, ``quick`` saying what it runs."""
    description = doc.split("\n\n")[0] if paragraph else doc.splitlines()[0]
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def format_table(header: Sequence[str], rows: Iterable[Sequence[object]], *, left: int = 1, notes: bool = False,
                 gap: int = 1) -> str:
    """A report table as text: the header line, then one line per row. Each column is as wide as
    its widest cell, ``gap`` spaces apart; the first ``left`` columns align left, the others right.
    Cells print as ``str`` gives them (format figures before), a short row's missing cells blank.
    ``notes``: the last column is free text, two spaces after the others, not aligned."""
    lines = [list(map(str, header)), *([str(c) for c in row] for row in rows)]
    lines = [cells + [""] * (len(header) - len(cells)) for cells in lines]
    aligned = len(header) - notes
    widths = [max(len(cells[i]) for cells in lines) for i in range(aligned)]
    out = []
    for cells in lines:
        line = (" " * gap).join(c.ljust(w) if i < left else c.rjust(w)
                                for i, (c, w) in enumerate(zip(cells[:aligned], widths)))
        out.append((line + "  " + cells[-1] if notes else line).rstrip())
    return "\n".join(out)


def print_table(title: str | None, header: Sequence[str], rows: Iterable[Sequence[object]], **kw) -> None:
    """``title`` (a line saying what the table measured, if any), then ``format_table``'s table."""
    if title:
        print(title)
    print(format_table(header, rows, **kw))


def ratio(a: float, b: float | None) -> str:
    """``a / b`` as the reports print a ratio: ``1.23x`` (``-`` when there is nothing to divide by)."""
    return f"{a / b:.2f}x" if b else "-"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def progress(message: str, *, bench: str | None = None) -> None:
    """A line on stderr (never in a bench's report on stdout): long runs show where they are."""
    prefix = f"[{bench} {time.strftime('%H:%M:%S')}] " if bench else ""
    print(f"{prefix}{message}", file=sys.stderr, flush=True)


def median_seconds(fn, reps: int) -> float:
    """The median wall time of ``reps`` calls of ``fn``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
