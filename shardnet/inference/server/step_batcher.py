"""Continuous batching on a block: the steps of different sessions that are ready at the same
moment run as one forward pass (``Block.forward_batch``).

Each session's step loop hands its step to ``StepBatcher.forward`` and waits. Whoever finds no
batch running runs batches itself (a *leader*, so no task outlives its owner): it takes waiting
steps round the upstream peers (one step of each peer in turn, as ``FairTurns`` shares turns),
up to ``max_tokens`` tokens (first yielding while a burst of steps is still being decoded by
their sessions' tasks, so that they join), runs them in a worker thread, hands each its output, and goes on while
steps wait and its own is not done; then it passes the lead to a waiting step's owner. A long
prompt is cut into chunks of at most ``max_tokens`` that take their turn like any other step, so
one long prefill never stalls everyone's decode steps for its whole length. Sessions join and
leave between batches; each keeps its own KV cache (rollbacks crop it as before).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import trio

log = logging.getLogger(__name__)

#: tokens one batch may hold (all steps together): a decode step is 1, a verify chunk k + 1.
#: c(b) grows by about 0.3 ms a token for tiny-llama on this CPU (docs/performance.md), so a
#: full batch adds tens of ms to its steps at most; long prompts are cut to this size.
DEFAULT_MAX_TOKENS = 256
#: before a batch: scheduler rounds without a new step that end the wait for more, and the most
#: rounds waited (a round costs microseconds; a forward pass, milliseconds)
GATHER_QUIET = 2
GATHER_ROUNDS = 32


@dataclass
class _Step:
    peer: str
    hidden: torch.Tensor  # [1, T, hidden]
    cache: object
    done_tokens: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    lead: bool = False  # told to take over running batches
    abandoned: bool = False  # its owner was cancelled: nothing more is computed for it
    wake: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    shared: bool = False  # some chunk of it ran in one forward pass with other sessions' steps

    @property
    def left(self) -> int:
        return self.hidden.shape[1] - self.done_tokens


@dataclass
class BatchStats:
    batches: int = 0
    steps: int = 0
    tokens: int = 0
    largest: int = 0  # most steps in one batch


class StepBatcher:
    def __init__(self, block, *, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.block = block
        self.max_tokens = max_tokens
        self._waiting: OrderedDict[str, deque[_Step]] = OrderedDict()  # per peer, in turn order
        #: a leader runs batches, or the lead is on its way to a waiting step's owner
        self._running = False
        self._arrived = 0  # steps handed in so far
        self.stats = BatchStats()

    async def forward(self, peer: str, hidden: torch.Tensor, cache, *,
                      on_shared: Callable[[], None] | None = None) -> torch.Tensor:
        """The block's output for ``hidden`` (the session's next positions), computed in a batch
        with whatever other sessions' steps are ready. ``on_shared`` is called when the step ran in
        one forward pass with other sessions' steps (receipts count those: batched results may
        round differently from a step computed alone)."""
        step = _Step(peer, hidden, cache)
        self._waiting.setdefault(peer, deque()).append(step)
        self._arrived += 1
        leading = False
        try:
            if self._running:
                while not step.finished and not step.lead:
                    await step.wake.wait()
                    step.wake = trio.Event()
            if not step.finished:
                self._running = leading = True
                step.lead = False
                await self._lead(step)
        except BaseException:
            step.abandoned = True
            self._remove(step)
            if step.lead:  # the lead came as we were cancelled: pass it on
                leading = True
            raise
        finally:
            if leading:
                self._hand_over()
        if step.error is not None:
            raise step.error
        if on_shared is not None and step.shared:
            on_shared()
        return torch.cat(step.outputs, dim=1) if len(step.outputs) > 1 else step.outputs[0]

    async def _lead(self, mine: _Step) -> None:
        while not mine.finished:
            await self._gather()  # (a cancelled leader stops here: between batches, not in one)
            batch = self._take_batch()
            if not batch:
                return
            inputs = [(s.hidden[:, s.done_tokens:s.done_tokens + n], s.cache) for s, n in batch]
            # shielded: once the caches are being extended, every step of the batch gets its output
            with trio.CancelScope(shield=True):
                try:
                    outs = await trio.to_thread.run_sync(self.block.forward_batch, inputs)
                except Exception as e:  # every step of the batch fails with it
                    outs = None
                    for s, _ in batch:
                        s.error = e
                self._settle(batch, outs)

    async def _gather(self) -> None:
        """Let the steps that are arriving right now join the batch. Steps of many sessions come
        in bursts (the previous peer ran them as one batch and sent them together), but each is
        read and decoded by its own session's task, a scheduler round or two apart: yield while
        rounds still bring steps (none for GATHER_QUIET rounds ends it, GATHER_ROUNDS at most)."""
        quiet = 0
        for _ in range(GATHER_ROUNDS):
            before = self._arrived
            await trio.lowlevel.checkpoint()
            quiet = quiet + 1 if self._arrived == before else 0
            if quiet >= GATHER_QUIET:
                return

    def _settle(self, batch: list[tuple[_Step, int]], outs) -> None:
        self.stats.batches += 1
        self.stats.steps += len(batch)
        self.stats.tokens += sum(n for _, n in batch)
        self.stats.largest = max(self.stats.largest, len(batch))
        for k, (s, n) in enumerate(batch):
            s.shared = s.shared or len(batch) > 1
            if outs is not None:
                s.outputs.append(outs[k])
                s.done_tokens += n
            if s.error is not None or s.left == 0:
                s.finished = True
                s.wake.set()
            elif not s.abandoned:  # a long prompt: its next chunk takes its turn again
                self._waiting.setdefault(s.peer, deque()).appendleft(s)

    def _take_batch(self) -> list[tuple[_Step, int]]:
        """Waiting steps round the peers (one of each peer per round), within the token budget;
        a step that does not fit whole takes what is left of the budget (its next chunk waits)."""
        batch: list[tuple[_Step, int]] = []
        budget = self.max_tokens
        while budget > 0 and self._waiting:
            for peer in list(self._waiting):
                if budget <= 0:
                    break
                queue = self._waiting[peer]
                step = queue.popleft()
                if queue:
                    self._waiting.move_to_end(peer)  # its other steps wait for the next round
                else:
                    del self._waiting[peer]
                n = min(step.left, budget)
                batch.append((step, n))
                budget -= n
        return batch

    def _hand_over(self) -> None:
        """The leader is done: the owner of the first waiting step leads next (its task is alive);
        with nothing waiting, the next step to arrive leads."""
        for queue in self._waiting.values():
            if queue:
                queue[0].lead = True
                queue[0].wake.set()
                return
        self._running = False

    def _remove(self, step: _Step) -> None:
        queue = self._waiting.get(step.peer)
        if queue is not None and step in queue:
            queue.remove(step)
            if not queue:
                del self._waiting[step.peer]
