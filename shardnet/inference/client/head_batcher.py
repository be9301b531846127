"""The client's LM head for all of its sessions at once.

A client that runs many sessions (a gateway) gets their results back in bursts: the last peer
runs a batch of steps and sends every session's output at about the same moment. Each session
then needs the final norm and LM head on its last positions. Run one at a time, every session pays
the head's fixed cost (the weight read, the Python overhead); run together, they pay it once.

No task leads and none waits on another: a session queues its rows and yields once, so that
the other sessions woken by the same burst queue theirs too; the first of them to run again
computes every queued request in one call, without awaiting, and the rest find their rows done.
A cancelled session just takes its request back. A request alone runs exactly as the head would
run it by itself, so one session's logits do not depend on whether batching is there. A head
whose computation takes more than ``THREAD_AFTER_S`` runs in a worker thread (torch lets go of
the GIL): the sessions whose results arrive meanwhile queue for the next computation, and the
event loop keeps sending and receiving every other session's frames instead of standing still.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
import trio


@dataclass
class _Request:
    hidden: torch.Tensor  # [1, T, hidden]
    result: torch.Tensor | None = None  # [T, vocab], float32
    error: BaseException | None = None


@dataclass
class HeadStats:
    calls: int = 0  # head computations
    rows: int = 0  # positions they covered
    requests: int = 0  # sessions' requests they answered
    largest: int = 0  # most requests in one computation


#: a head computation that took longer than this runs the next ones in a worker thread
THREAD_AFTER_S = 0.002


class HeadBatcher:
    """``logits(hidden)`` for any number of concurrent sessions, computed together."""

    def __init__(self, head) -> None:
        self.head = head
        self._waiting: list[_Request] = []
        self.stats = HeadStats()
        #: set while a computation runs in a worker thread
        self._busy: trio.Event | None = None
        self._in_thread = False

    async def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, T, hidden] -> [T, vocab] (float32): the head's logits of these positions."""
        request = _Request(hidden)
        self._waiting.append(request)
        try:
            await trio.lowlevel.checkpoint()  # the sessions woken with us queue theirs
            while request.result is None and request.error is None:
                if self._busy is not None:  # a computation runs; ours is in the next one
                    await self._busy.wait()
                else:
                    await self._run_waiting()
        except BaseException:
            if request in self._waiting:
                self._waiting.remove(request)
            raise
        if request.error is not None:
            raise request.error
        return request.result

    async def _run_waiting(self) -> None:
        """Compute every queued request: on the event loop while a computation is quick, else in
        a worker thread, so that the loop keeps moving other sessions' frames meanwhile (a large
        head, e.g. 2,048 x 32,000 in float16, takes about 20 ms on one CPU core)."""
        batch, self._waiting = self._waiting, []
        if not self._in_thread:
            self._compute(batch)
            return
        self._busy = trio.Event()
        try:
            await trio.to_thread.run_sync(self._compute, batch)  # (a cancel waits for it to finish)
        finally:
            self._busy.set()
            self._busy = None

    def _compute(self, batch: list[_Request]) -> None:
        t0 = time.perf_counter()
        try:
            if len(batch) == 1:
                batch[0].result = self.head.logits(batch[0].hidden)[0]
            else:
                sizes = [r.hidden.shape[1] for r in batch]
                rows = torch.cat([r.hidden[0].to(batch[0].hidden.dtype) for r in batch])[None]
                for r, out in zip(batch, self.head.logits(rows)[0].split(sizes)):
                    r.result = out
        except Exception as e:  # every request of the computation fails with it
            for r in batch:
                r.error = e
        self._in_thread = time.perf_counter() - t0 > THREAD_AFTER_S
        self.stats.calls += 1
        self.stats.requests += len(batch)
        self.stats.rows += sum(r.hidden.shape[1] for r in batch)
        self.stats.largest = max(self.stats.largest, len(batch))


_batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_batcher(head) -> HeadBatcher:
    """The one batcher of ``head`` (a model's ``Head``), shared by every session that uses it."""
    batcher = _batchers.get(head)
    if batcher is None:
        batcher = _batchers[head] = HeadBatcher(head)
    return batcher
