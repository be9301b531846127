"""The simulation's clock: simulated seconds, a heap of events due at given times, and a fixed
tick between them.

``run`` advances the clock by ``TICK_S`` at a time: first every event due by then (in the order
of their times, and of their scheduling among equal times), then the tick, then a sample every
``SAMPLE_S`` and a progress call every ``PROGRESS_S``. Nothing here knows what the events are
(bench/swarm_sim/swarm.py and traffic.py schedule them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

#: simulated seconds between two ticks (requests' progress is recomputed every tick)
TICK_S = 2.0
#: simulated seconds between two samples
SAMPLE_S = 60.0
#: simulated seconds between two calls of ``run``'s progress callback
PROGRESS_S = 600.0


class EventLoop:
    """A simulated clock from 0 to ``end`` seconds, and the events scheduled on it."""

    def __init__(self, end: float) -> None:
        self.now = 0.0
        self.end = end
        self._events: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` at simulated time ``t``."""
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def later(self, dt: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` ``dt`` simulated seconds from now."""
        self.at(self.now + dt, fn)

    def run_until(self, t: float) -> None:
        """Call every event due by ``t``, in order, then stand at ``t``."""
        while self._events and self._events[0][0] <= t:
            when, _, fn = heapq.heappop(self._events)
            self.now = when
            fn()
        self.now = t

    def run(self, tick: Callable[[float], None], sample: Callable[[], None],
            progress: Callable[[float], None] | None = None) -> None:
        """Run to the end: ``tick(TICK_S)`` every tick, after the events due by then;
        ``sample()`` every ``SAMPLE_S``; ``progress(simulated seconds)`` every ``PROGRESS_S``."""
        t = 0.0
        next_sample = 0.0
        next_progress = PROGRESS_S
        while t < self.end:
            self.run_until(t)
            tick(TICK_S)
            if t >= next_sample:
                sample()
                next_sample += SAMPLE_S
            if progress is not None and t >= next_progress:
                progress(t)
                next_progress += PROGRESS_S
            t += TICK_S
