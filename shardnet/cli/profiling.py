"""Opt-in profiling of a ``shardnet`` command: where a process's CPU time goes.

``SHARDNET_PROFILE=PATH shardnet join ...`` runs the command's event loop under the standard
library's cProfile, timed in CPU seconds of the event loop's thread (``time.thread_time``: an idle
peer's waits in epoll cost nothing), and writes its statistics to PATH (pstats' format: read it
with ``python -m pstats PATH`` or ``bench/idle_swarm.py``'s categories) when the command ends, a
SIGTERM included. Two signals scope it to a window of a running process:

- SIGUSR1: start afresh (what was collected so far is dropped);
- SIGUSR2: write PATH now (atomically: a reader never sees half a file), and go on.

cProfile rather than a sampling profiler: py-spy (the well-kept sampler) cannot attach to a
running process on this machine (it fails to read the target's memory), and in-process samplers
(pyinstrument, yappi) are not installed; cProfile also counts calls, which gives message counts
for free. Its price: every Python call costs more, so a profiled process uses more CPU than an
unprofiled one (bench/idle_swarm.py leaves the profiled peer out of its CPU figures); shares
between functions are what it measures well.
"""

from __future__ import annotations

import cProfile
import marshal
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "SHARDNET_PROFILE"


class Profiler:
    """cProfile in CPU seconds of this thread, restartable and dumpable from signal handlers."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.profile = cProfile.Profile(time.thread_time)

    def start_afresh(self, *_: object) -> None:
        self.profile.disable()
        self.profile = cProfile.Profile(time.thread_time)
        self.profile.enable()

    def dump(self, *_: object) -> None:
        self.profile.disable()
        try:
            self.profile.create_stats()
            tmp = f"{self.path}.tmp"
            with open(tmp, "wb") as f:
                marshal.dump(self.profile.stats, f)
            os.replace(tmp, self.path)
        finally:
            self.profile.enable()


@contextmanager
def profiled_if_asked() -> Iterator[None]:
    """Profile what runs inside when ``$SHARDNET_PROFILE`` names a file (else nothing)."""
    path = os.environ.get(ENV)
    if not path:
        yield
        return
    profiler = Profiler(path)
    before = {sig: signal.signal(sig, handler)
              for sig, handler in ((signal.SIGUSR1, profiler.start_afresh), (signal.SIGUSR2, profiler.dump))}
    profiler.profile.enable()
    try:
        yield
    finally:
        profiler.dump()
        profiler.profile.disable()
        for sig, handler in before.items():
            signal.signal(sig, handler)
