"""``SessionSlots``: the line a node's requests wait in for a session slot at a first hop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from shardnet.errors import InferenceError
from shardnet.protocols.activation import ErrorCode


class SessionSlots:
    """Sessions this node holds open per first hop, at most ``per_peer`` each (the node's
    ``sessions_out_per_peer``; one per node, in its ``InferenceServices``, shared by every client
    of it). More wait in line, first come first served (a trio.Semaphore wakes its waiters in
    order)."""

    def __init__(self, per_peer: int) -> None:
        self.per_peer = per_peer
        self._sems: dict[str, trio.Semaphore] = {}

    @asynccontextmanager
    async def hold(self, peer: str, deadline: float) -> AsyncIterator[None]:
        sem = self._sems.get(peer)
        if sem is None:
            sem = self._sems[peer] = trio.Semaphore(self.per_peer)
        try:
            with trio.move_on_at(deadline) as waited:
                await sem.acquire()
            if waited.cancelled_caught:
                raise InferenceError(ErrorCode.BUSY, f"no session slot at {peer[:16]}… within the queue timeout "
                                     f"({self.per_peer} sessions per peer, sessions_out_per_peer)", peer)
            try:
                yield
            finally:
                sem.release()
        finally:
            if sem.value == self.per_peer and not sem.statistics().tasks_waiting:
                self._sems.pop(peer, None)
