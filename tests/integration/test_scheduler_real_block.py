"""``BlockScheduler`` with a real block: ready steps run together and equal ``Block.forward``, a long
prompt is cut into chunks that interleave with decode steps and still equals its forward, and a
cancelled session never stalls the others. (The order of passes, with a recording fake block, is
in tests/unit/inference/test_block_scheduler.py.)"""

import time

import torch
import trio

from shardnet.inference.model.block import Block
from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.random_model import init_random
from shardnet.inference.server.scheduler import BlockScheduler


class RecordingBlock:
    """The real block, recording which sessions (by cache) and how many tokens each pass held."""

    def __init__(self, block, pause_s: float = 0.0):
        self.block, self.batches, self.pause_s = block, [], pause_s

    def forward(self, hidden, cache, pos):
        self.batches.append([(id(cache), hidden.shape[1])])
        time.sleep(self.pause_s)
        return self.block.forward(hidden, cache, pos)

    def forward_batch(self, steps):
        self.batches.append([(id(cache), h.shape[1]) for h, cache in steps])
        time.sleep(self.pause_s)  # in the worker thread: time for a test to act between batches
        return self.block.forward_batch(steps)

    def new_cache(self):
        return self.block.new_cache()


def make_block(tmp_path):
    path = init_random(tmp_path / "m", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=300, seed=4)
    return Block(Checkpoint(path), 0, 2)


def hidden(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, 32, generator=g)


async def test_steps_ready_together_run_as_one_batch_and_equal_forward(tmp_path):
    block = make_block(tmp_path)
    rec = RecordingBlock(block)
    scheduler = BlockScheduler(rec, max_tokens=64)
    caches = [block.new_cache() for _ in range(4)]
    results = {}

    async def step(i):
        results[i] = await scheduler.forward(f"peer{i % 2}", hidden(3 + i, i), caches[i], 0)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(step, i)
    # the first arrival leads, and yields once before its first batch: the others join it
    assert [len(b) for b in rec.batches] == [4]
    for i in range(4):
        want = block.forward(hidden(3 + i, i), block.new_cache(), 0)
        assert (results[i] - want).abs().max().item() < 1e-5
        assert caches[i].get_seq_length() == 3 + i


async def test_a_long_prompt_is_chunked_and_decode_steps_go_between(tmp_path):
    block = make_block(tmp_path)
    rec = RecordingBlock(block)
    scheduler = BlockScheduler(rec, max_tokens=16)
    long_cache, short_cache = block.new_cache(), block.new_cache()
    block.forward(hidden(4, 9), short_cache, 0)
    done = []

    async def long_prompt():
        out = await scheduler.forward("a", hidden(100, 1), long_cache, 0)
        done.append(("long", out))

    async def decode_steps():
        for k in range(3):
            await scheduler.forward("b", hidden(1, 10 + k), short_cache, 4 + k)
            done.append(("short", k))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_prompt)
        await trio.sleep(0)
        nursery.start_soon(decode_steps)
    assert [d[0] for d in done][:3] == ["short"] * 3  # all three decode steps before the prompt's end
    out = done[-1][1]
    want = block.forward(hidden(100, 1), block.new_cache(), 0)
    assert out.shape == want.shape and (out - want).abs().max().item() < 1e-4
    assert max(sum(n for _, n in b) for b in rec.batches) <= 16 and len(rec.batches) >= 7


async def test_a_cancelled_leader_hands_over_and_the_others_finish(tmp_path):
    """The session running passes (a long prompt) is cancelled between two of its chunks: a
    waiting session takes over, finishes, and the scheduler serves new steps afterwards."""
    block = make_block(tmp_path)
    rec = RecordingBlock(block, pause_s=0.2)
    scheduler = BlockScheduler(rec, max_tokens=8)
    results = {}

    async def step(name, n, cache):
        results[name] = await scheduler.forward(name, hidden(n), cache, 0)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as leader_scope:
                async with trio.open_nursery() as inner:
                    inner.start_soon(step, "leader", 40, block.new_cache())
                    await trio.sleep(0)
                    nursery.start_soon(step, "waiting", 1, block.new_cache())
                    while len(rec.batches) < 2:
                        await trio.sleep(0.001)
                    leader_scope.cancel()
        assert "leader" not in results and results["waiting"].shape[1] == 1
        await step("later", 3, block.new_cache())
    assert results["later"].shape[1] == 3
    assert not scheduler._running and not scheduler.waiting
