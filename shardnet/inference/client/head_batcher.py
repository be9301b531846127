"""The client's LM head for all of its sessions at once.

A client that runs many sessions (a gateway) gets their results back in bursts: the last peer
runs a batch of steps and sends every session's output at about the same moment. Each session
then needs the final norm and LM head on its last positions. Run one at a time, every session pays
the head's fixed cost (the weight read, the Python overhead); run together, they pay it once.

No task leads and none waits on another: a session queues its rows and yields once, so that
the other sessions woken by the same burst queue theirs too; the first of them to run again
computes every queued request in one call, without awaiting, and the rest find their rows done.
A cancelled session just takes its request back. A request alone runs exactly as the head would
run it by itself, so one session's logits do not depend on whether batching is there.
"""

from __future__ import annotations

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


class HeadBatcher:
    """``logits(hidden)`` for any number of concurrent sessions, computed together."""

    def __init__(self, head) -> None:
        self.head = head
        self._waiting: list[_Request] = []
        self.stats = HeadStats()

    async def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, T, hidden] -> [T, vocab] (float32): the head's logits of these positions."""
        request = _Request(hidden)
        self._waiting.append(request)
        try:
            await trio.lowlevel.checkpoint()  # the sessions woken with us queue theirs
        except BaseException:
            if request in self._waiting:
                self._waiting.remove(request)
            raise
        if request.result is None and request.error is None:
            self._run_waiting()
        if request.error is not None:
            raise request.error
        return request.result

    def _run_waiting(self) -> None:
        batch, self._waiting = self._waiting, []
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
