"""One scheduler per block: every step of every session that a block serves runs through its
``BlockScheduler``, which decides what each forward pass of the block holds.

Steps wait in queues per upstream peer; the peers take turns (a peer that gave a step goes to the
back of the round, each peer's steps go in arrival order), so a peer with 16 sessions cannot take
16 turns for every turn of a peer with one. With a token budget (``join --batch-tokens N``, N > 0,
the default 256) a pass holds up to N tokens of several sessions' steps (``Block.forward_batch``),
taken in this order:

1. **short steps first**: steps of at most ``SHORT_STEP_TOKENS`` tokens (a decode position, a
   verify chunk of speculative decoding), round the peers, while they fit the budget. A short
   step is never split; one that does not fit waits at the front of the round for the next pass.
2. **then prompts** (chunked prefill): longer steps fill what is left of the budget, round the
   peers. One longer than what is left runs a chunk of that size now and keeps its place at its
   peer's front for the next pass, so a long prompt goes chunk by chunk with other sessions'
   decode steps in every pass between its chunks instead of stalling them for its whole length.
   While a prompt waits, short steps leave it at least ``PREFILL_SHARE`` of the budget, so
   prefill advances in every pass however many sessions are decoding.

A short step overtakes a prompt of the same peer (they are different sessions: a session has one
step in flight). A verify chunk longer than ``SHORT_STEP_TOKENS`` counts as a prompt: it runs
whole where it fits what is left of the pass, else in chunks (exact either way; only its latency
differs).

With ``max_tokens=0`` (``--batch-tokens 0``) there is no batching: a pass holds one whole step,
the next in turn round the peers (``Block.forward``; no budget, so no chunks). A step of a
sub-span session (one that runs only some of the block's layers) is never batched with other
sessions' steps: with a budget it waits in a round of its own, and a pass of one holds it alone,
at most the budget of it (a long prompt goes in chunks, as above), taking turns with the batched
passes of the other sessions; without a budget it runs whole, as every step does. A step whose
position is not where its cache ends (not in the protocol's normal flow: the endpoint crops the
cache on a rollback first) runs the same way, whole and alone in a pass of its own at its
position, before the next batch.

No task outlives its owner: each session's step loop hands its step to ``forward`` and waits.
Whoever finds no pass running runs passes itself (the *leader*): before each it yields while a
burst of steps is still being decoded by their sessions' tasks, so they join; runs the pass in
a worker thread, shielded (once caches are being extended, every step in it gets its output);
hands each step its output; and goes on while its own step is not done, then hands the lead to
the owner of a waiting step. A step cancelled while it waits leaves its queue; one cancelled in
the middle of a chunked prompt gets no more chunks. Sessions join and leave between passes; each
keeps its own KV cache (rollbacks crop it as before).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import trio

log = logging.getLogger(__name__)

#: tokens one forward pass may hold (all its steps together): a decode step is 1, a verify chunk
#: k + 1. c(b) grows by about 0.3 ms a token for tiny-llama on this CPU (docs/performance.md), so
#: a full pass adds tens of ms to its steps at most; long prompts are cut to fit it.
DEFAULT_MAX_TOKENS = 256
#: steps of at most this many tokens are *short* (decode positions and verify chunks: what a
#: session waits on token by token) and go before prompts; longer steps are prompts, chunked
SHORT_STEP_TOKENS = 32
#: the least share of a pass's budget that short steps leave to a waiting prompt
PREFILL_SHARE = 1 / 8
#: before a batch: scheduler rounds without a new step that end the wait for more, and the most
#: rounds waited (a round costs microseconds; a forward pass, milliseconds)
GATHER_QUIET = 2
GATHER_ROUNDS = 32
#: a session counts as decoding here while it had a short step in one of the last this many passes
ACTIVE_PASSES = 4


@dataclass(eq=False)
class _Step:
    peer: object
    hidden: torch.Tensor  # [1, T, hidden]
    cache: object
    pos: int
    done_tokens: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    pipelined: bool = False  # its session's chain has other stages (peers, or the client's head)
    lead: bool = False  # told to take over running passes
    abandoned: bool = False  # its owner was cancelled: nothing more is computed for it
    wake: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    shared: bool = False  # some chunk of it ran in one forward pass with other sessions' steps
    waiting: _Round | None = None  # where it waits for its turn
    tree: tuple[int, ...] | None = None  # a tree step's parents (it runs alone)
    layers: tuple[int, int] | None = None  # a sub-span session's layers (it runs alone)

    @property
    def left(self) -> int:
        return self.hidden.shape[1] - self.done_tokens


class _Round:
    """Waiting steps of one kind: a queue per upstream peer, the peers in the order of their turns."""

    def __init__(self) -> None:
        self.queues: OrderedDict[object, deque[_Step]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self.queues)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def add(self, step: _Step, *, front: bool = False) -> None:
        """At the back of its peer's queue (``front``: at the front, a prompt's next chunk); a peer
        with nothing waiting joins the round at its back."""
        queue = self.queues.setdefault(step.peer, deque())
        queue.appendleft(step) if front else queue.append(step)

    def peek(self) -> _Step:
        return next(iter(self.queues.values()))[0]

    def pop(self) -> _Step:
        """The step whose turn it is; its peer goes to the back of the round."""
        peer, queue = next(iter(self.queues.items()))
        step = queue.popleft()
        if queue:
            self.queues.move_to_end(peer)
        else:
            del self.queues[peer]
        return step

    def steps(self):
        return (s for q in self.queues.values() for s in q)

    def remove(self, step: _Step) -> bool:
        queue = self.queues.get(step.peer)
        if queue is None or step not in queue:
            return False
        queue.remove(step)
        if not queue:
            del self.queues[step.peer]
        return True


@dataclass
class SchedulerStats:
    passes: int = 0  # forward passes run
    steps: int = 0  # steps (and prompt chunks) in them
    tokens: int = 0
    largest: int = 0  # most steps in one pass


class BlockScheduler:
    def __init__(self, block, *, max_tokens: int = DEFAULT_MAX_TOKENS, short_tokens: int = SHORT_STEP_TOKENS) -> None:
        """``max_tokens``: the token budget of a pass (0: one whole step per pass, no batching)."""
        self.block = block
        self.max_tokens = max_tokens
        #: tokens short steps leave to a waiting prompt, and the most a short step may have (a
        #: budget too small for SHORT_STEP_TOKENS makes the short steps smaller, not split)
        self.prefill_floor = max(1, int(max_tokens * PREFILL_SHARE))
        self.short_tokens = max(0, min(short_tokens, max_tokens - self.prefill_floor))
        self._alone, self._short, self._long = _Round(), _Round(), _Round()
        #: sub-span sessions' steps: each pass of one holds it alone, in chunks of the budget
        self._sub = _Round()
        self._sub_turn = False  # a sub-span step goes next when others wait too
        #: a leader runs passes, or the lead is on its way to a waiting step's owner
        self._running = False
        self._arrived = 0  # steps handed in so far
        #: pipelined sessions' caches -> the last pass that held a short step of theirs
        self._decoding: dict[int, int] = {}
        self.split = os.environ.get("SHARDNET_SPLIT_PASSES", "1") != "0"
        self.stats = SchedulerStats()

    @property
    def batching(self) -> bool:
        """Whether a pass may hold several sessions' steps (receipts say so)."""
        return self.max_tokens > 0

    @property
    def waiting(self) -> int:
        return len(self._alone) + len(self._sub) + len(self._short) + len(self._long)

    async def forward(self, peer, hidden: torch.Tensor, cache, pos: int, *,
                      on_shared: Callable[[], None] | None = None, pipelined: bool = False,
                      tree: tuple[int, ...] | None = None, layers: tuple[int, int] | None = None) -> torch.Tensor:
        """The block's output for ``hidden`` ([1, T, hidden]: a session's positions from ``pos``,
        extending ``cache``), computed when the scheduler's order comes to it, possibly in one pass
        with other sessions' steps. ``peer``: the upstream peer it came from. ``on_shared`` is
        called when the step ran in one forward pass with other sessions' steps (receipts count
        those: batched results may round differently from a step computed alone). ``tree``: the
        step is a tree of drafts (``Block.forward``), run in a pass of its own. ``layers``: the
        session runs only those of the block (a sub-span session, ``Block.forward``), each step
        in a pass of its own."""
        step = _Step(peer, hidden, cache, pos, pipelined=pipelined, tree=tree, layers=layers)
        step.waiting = self._round_for(step)
        step.waiting.add(step)
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
            step.waiting.remove(step)
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

    def _round_for(self, step: _Step) -> _Round:
        if not self.batching or step.tree is not None or step.pos != step.cache.get_seq_length():
            return self._alone
        if step.layers is not None:
            return self._sub
        return self._short if step.hidden.shape[1] <= self.short_tokens else self._long

    async def _lead(self, mine: _Step) -> None:
        while not mine.finished:
            # (a cancelled leader stops here: between passes, not in one)
            await (self._gather() if self.batching else trio.lowlevel.checkpoint())
            batch = self._take_pass()
            if not batch:
                return
            # shielded: once the caches are being extended, every step of the pass gets its output
            with trio.CancelScope(shield=True):
                try:
                    outs = await trio.to_thread.run_sync(self._pass_fn(batch))
                except Exception as e:  # every step of the pass fails with it
                    outs = None
                    for s, _ in batch:
                        s.error = e
                self._settle(batch, outs)

    async def _gather(self) -> None:
        """Let the steps that are arriving right now join the pass. Steps of many sessions come
        in bursts (the previous peer ran them as one pass and sent them together), but each is
        read and decoded by its own session's task, a scheduler round or two apart: yield while
        rounds still bring steps (none for GATHER_QUIET rounds ends it, GATHER_ROUNDS at most)."""
        quiet = 0
        for _ in range(GATHER_ROUNDS):
            before = self._arrived
            await trio.lowlevel.checkpoint()
            quiet = quiet + 1 if self._arrived == before else 0
            if quiet >= GATHER_QUIET:
                return

    def _take_pass(self) -> list[tuple[_Step, int]]:
        """The next pass: (step, tokens of it) each, in the module docstring's order."""
        if self._alone:  # whole, in a pass of its own
            step = self._alone.pop()
            return [(step, step.left)]
        if self._sub and (self._sub_turn or not (self._short or self._long)):
            # a sub-span step alone, at most the budget of it, taking turns with the batches
            self._sub_turn = False
            step = self._sub.pop()
            return [(step, min(step.left, self.max_tokens))]
        self._sub_turn = True
        batch: list[tuple[_Step, int]] = []
        budget = self.max_tokens
        for_short = budget - (self.prefill_floor if self._long else 0)
        most = self._short_steps_per_pass()
        while self._short and self._short.peek().left <= for_short and len(batch) < most:
            step = self._short.pop()
            batch.append((step, step.left))
            for_short -= step.left
            budget -= step.left
            if step.pipelined:
                self._decoding[id(step.cache)] = self.stats.passes
        while self._long and budget > 0:
            step = self._long.pop()
            n = min(step.left, budget)
            batch.append((step, n))
            budget -= n
        return batch

    def _short_steps_per_pass(self) -> int:
        """At most half the decoding sessions of multi-stage chains in one pass: the two halves
        take turns, one here while the other is at the chain's other stages, so that the stages
        compute at once instead of in turn (a pass of all of them leaves every other stage idle
        while it runs)."""
        if not self.split:
            return 1 << 30
        recent = self.stats.passes - ACTIVE_PASSES
        self._decoding = {k: v for k, v in self._decoding.items() if v >= recent}
        waiting = {id(s.cache) for s in self._short.steps() if s.pipelined}
        active = len(waiting | self._decoding.keys())
        return max(1, -(-active // 2)) if active >= 2 else 1 << 30

    def _pass_fn(self, batch: list[tuple[_Step, int]]) -> Callable[[], list[torch.Tensor]]:
        step, n = batch[0]
        kw = {"tree": step.tree} if step.tree is not None else {}
        if step.layers is not None:  # a sub-span step (or a chunk of it), alone at its cache's end
            d = step.done_tokens
            return lambda: [self.block.forward(step.hidden[:, d:d + n], step.cache, step.pos + d,
                                               layers=step.layers, **kw)]
        if len(batch) == 1 and n == step.left and step.done_tokens == 0:
            # one whole step: the plain path, at the step's own position
            return lambda: [self.block.forward(step.hidden, step.cache, step.pos, **kw)]
        return partial(self.block.forward_batch,
                       [(s.hidden[:, s.done_tokens:s.done_tokens + n], s.cache) for s, n in batch])

    def _settle(self, batch: list[tuple[_Step, int]], outs) -> None:
        self.stats.passes += 1
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
                s.waiting.add(s, front=True)

    def _hand_over(self) -> None:
        """The leader is done: the owner of a waiting step leads next (its task is alive); with
        nothing waiting, the next step to arrive leads."""
        for waiting in (self._alone, self._sub, self._short, self._long):
            if waiting:
                step = waiting.peek()
                step.lead = True
                step.wake.set()
                return
        self._running = False
