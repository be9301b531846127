"""The session interface ``generate_on`` drives (``send``, ``receive``), served by one Block in
this process under the peers' rules (the block side of the protocol's session machine): a
position below the cache length rolls the cache back, and a step is dropped when a newer epoch
is already queued behind it. Used to recompute a run locally (``shardnet verify --recompute``)
and by tests of the decode loop."""

from __future__ import annotations

import sys

import torch

from shardnet.errors import InferenceError
from shardnet.inference.model.block import Block
from shardnet.protocols.activation import Step
from shardnet.protocols.activation_session import (
    BlockSession,
    Compute,
    ReplyError,
    Skip,
)


class LocalSession:
    def __init__(self, block: Block, *, drop_stale: bool = True) -> None:
        self.block, self.cache = block, block.new_cache()
        # no max_len of its own: the model's positions bound it
        self.machine = BlockSession.local(block.config.hidden_size, sys.maxsize)
        #: steps sent and not yet received, with their hidden states
        self.queue: list[tuple[Step, torch.Tensor]] = []
        self.step_no, self.drop_stale = 0, drop_stale

    @property
    def length(self) -> int:
        """Positions the cache holds."""
        return self.machine.cursor.length

    async def send(self, hidden, *, pos, logits_for=1, epoch=0):
        step = Step(self.machine.session, n=self.step_no, pos=pos, dtype="float32", shape=tuple(hidden.shape),
                    logits_for=logits_for, epoch=epoch)  # no payload: the tensor stays beside it
        self.queue.append((step, hidden))
        self.step_no += 1
        return step.n

    async def receive(self):
        while True:
            step, hidden = self.queue.pop(0)
            action = self.machine.receive(step, [q for q, _ in self.queue] if self.drop_stale else ())
            if not isinstance(action, Skip):
                break
        if isinstance(action, ReplyError):
            raise InferenceError(action.code, action.message)
        assert isinstance(action, Compute)
        if action.drop > 0:
            self.cache.crop(-action.drop)
        out = self.block.forward(hidden, self.cache, step.pos)
        return step.n, out
