"""One forward pass at a time on a block, with turns shared fairly between upstream peers.

A FIFO lock would give a peer with 16 sessions 16 turns for every turn of a peer with one: the
turns go round the peers instead (each peer's own waiters in arrival order), so a client's step
waits for at most one step of each other peer, however many sessions they hold.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio


class FairTurns:
    def __init__(self) -> None:
        self._busy = False
        #: peers with someone waiting, in the order their turn comes; each peer's waiters in order
        self._waiting: OrderedDict[str, deque[trio.Event]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @asynccontextmanager
    async def turn(self, peer: str) -> AsyncIterator[None]:
        if not self._busy:
            self._busy = True
        else:
            granted = trio.Event()
            self._waiting.setdefault(peer, deque()).append(granted)
            try:
                await granted.wait()
            except BaseException:
                if granted.is_set():  # the turn came as we were cancelled: pass it on
                    self._next()
                else:
                    queue = self._waiting[peer]
                    queue.remove(granted)
                    if not queue:
                        del self._waiting[peer]
                raise
        try:
            yield
        finally:
            self._next()

    def _next(self) -> None:
        """Hand the turn to the first waiting peer, which then goes to the back of the round."""
        if not self._waiting:
            self._busy = False
            return
        peer, queue = self._waiting.popitem(last=False)
        granted = queue.popleft()
        if queue:
            self._waiting[peer] = queue
        granted.set()
