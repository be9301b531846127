"""The session interface ``generate_on`` drives (``send``, ``receive``), served by one Block in
this process under the peers' rules: a position below the cache length rolls the cache back,
and a step is dropped when a newer epoch is already queued behind it. Used to recompute a run
locally (``shardnet verify --recompute``) and by tests of the decode loop."""

from __future__ import annotations

from shardnet.inference.model.block import Block


class LocalSession:
    def __init__(self, block: Block, *, drop_stale: bool = True) -> None:
        self.block, self.cache, self.length = block, block.new_cache(), 0
        self.queue: list[tuple] = []
        self.step_no, self.drop_stale = 0, drop_stale

    async def send(self, hidden, *, pos, logits_for=1, epoch=0):
        self.queue.append((self.step_no, hidden, pos, logits_for, epoch))
        self.step_no += 1
        return self.step_no - 1

    async def receive(self):
        while True:
            n, hidden, pos, logits_for, epoch = self.queue.pop(0)
            if not (self.drop_stale and any(q[4] > epoch for q in self.queue)):
                break
        if pos < self.length:
            self.cache.crop(pos - self.length)
            self.length = pos
        out = self.block.forward(hidden, self.cache, self.length)
        self.length += hidden.shape[1]
        return n, out
