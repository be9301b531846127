"""``BlockScheduler``'s order of passes, with a fake block that records what each forward pass
held: short steps before prompt chunks, turns round the upstream peers, the token budget, chunked
prefill, cancellation, and ``max_tokens=0`` (one whole step per pass, in fair turns). Exactness
against a real block is in tests/integration/test_scheduler_real_block.py."""

import threading

import torch
import trio

from shardnet.inference.server.scheduler import BlockScheduler


class FakeCache:
    def __init__(self, name: str, length: int = 0):
        self.name, self.length = name, length

    def get_seq_length(self) -> int:
        return self.length


class FakeBlock:
    """Returns its input (so a chunked step's output shows the chunks were put back in order) and
    records each pass: ("forward" or "batch", [(cache name, tokens), ...]). Each pass waits for the
    test to let it end (``allow``, ``open``: a test acts while a pass runs); a pass holding a cache
    named in ``fail`` raises."""

    def __init__(self, fail: tuple[str, ...] = ()):
        self.passes: list[tuple[str, list[tuple[str, int]]]] = []
        self.running, self.fail = threading.Event(), fail
        self._gate, self._allowed = threading.Condition(), 0.0

    def allow(self, passes: float) -> None:
        with self._gate:
            self._allowed += passes
            self._gate.notify_all()

    def open(self) -> None:
        self.allow(float("inf"))

    async def pass_running(self) -> None:
        """Until a pass runs (in its worker thread, waiting to be let end)."""
        while not self.running.is_set():
            await trio.sleep(0.001)

    def _run(self):
        self.running.set()
        with self._gate:
            assert self._gate.wait_for(lambda: self._allowed > 0, timeout=10)
            self._allowed -= 1
        if any(name in self.fail for name, _ in self.passes[-1][1]):
            raise RuntimeError("out of memory")

    def forward(self, hidden, cache, pos, layers=None):
        self.passes.append(("forward", [(cache.name, hidden.shape[1])] + ([layers] if layers else [])))
        self._run()
        cache.length = pos + hidden.shape[1]
        return hidden.clone()

    def forward_batch(self, steps):
        self.passes.append(("batch", [(cache.name, h.shape[1]) for h, cache in steps]))
        self._run()
        for h, cache in steps:
            cache.length += h.shape[1]
        return [h.clone() for h, _ in steps]

    def names(self):
        return [[name for name, _ in held] for _, held in self.passes]


def activations(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, n, 4, generator=torch.Generator().manual_seed(seed))


async def hand_in(scheduler, nursery, peer, cache, n, results, pos=None, on_shared=None, pipelined=False,
                  layers=None):
    """Start a session's step; returns once it waits in the scheduler. Its (input, output) goes to
    ``results[cache.name]``."""
    async def one(task_status=trio.TASK_STATUS_IGNORED):
        h = activations(n, len(results))
        task_status.started()  # (synchronous: the step is queued before the caller runs again)
        results[cache.name] = (h, await scheduler.forward(peer, h, cache, cache.length if pos is None else pos,
                                                          on_shared=on_shared, pipelined=pipelined,
                                                          **({"layers": layers} if layers else {})))
    await nursery.start(one)


async def hand_in_burst(scheduler, steps, results=None, pipelined=False):
    """Hand in ``steps`` (peer, cache, tokens) in this order while a pass of another session's
    runs, so that all of them wait for the next (as a burst from upstream does); the passes they
    took then are in ``scheduler.block.passes`` (the first pass, the other session's, left out)."""
    block, results = scheduler.block, {} if results is None else results
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await hand_in(scheduler, nursery, "upstream", FakeCache("running"), 1, {})
            await block.pass_running()
            for peer, cache, n in steps:
                await hand_in(scheduler, nursery, peer, cache, n, results, pipelined=pipelined)
            block.open()
    del block.passes[0]
    return results


async def test_short_steps_go_first_then_prompt_chunks_fill_the_budget():
    scheduler = BlockScheduler(FakeBlock(), max_tokens=64)
    prompt = FakeCache("prompt")
    results = await hand_in_burst(scheduler, [("p", prompt, 100), ("a", FakeCache("a", 7), 1),
                                      ("b", FakeCache("b", 9), 1), ("c", FakeCache("verify", 12), 5)])
    # the prompt came first, yet the decode steps and the verify chunk lead the pass; the prompt
    # fills the rest of the budget (64 - 7) and its other 43 tokens take the next pass
    assert scheduler.block.passes == [("batch", [("a", 1), ("b", 1), ("verify", 5), ("prompt", 57)]),
                                      ("batch", [("prompt", 43)])]
    h, out = results["prompt"]
    assert torch.equal(out, h) and prompt.length == 100  # the chunks' outputs, in order
    st = scheduler.stats  # (the first pass: the session that ran while the others came)
    assert (st.passes, st.steps, st.tokens, st.largest) == (3, 6, 108, 4) and not scheduler.waiting


async def test_turns_go_round_the_peers_within_the_budget():
    """A peer with many sessions cannot fill a pass at the expense of a peer with one; each peer's
    steps go in the order they came."""
    scheduler = BlockScheduler(FakeBlock(), max_tokens=16)
    busy = [("busy", FakeCache(f"busy{i}"), 4) for i in range(6)]
    await hand_in_burst(scheduler, busy + [("lone", FakeCache("lone"), 2)])
    assert scheduler.block.names() == [["busy0", "lone", "busy1", "busy2"], ["busy3", "busy4", "busy5"]]


async def test_a_short_step_is_never_split_it_waits_for_the_next_pass():
    scheduler = BlockScheduler(FakeBlock(), max_tokens=16)
    await hand_in_burst(scheduler, [("a", FakeCache("a0"), 10), ("b", FakeCache("b0"), 10)])
    assert scheduler.block.passes == [("forward", [("a0", 10)]), ("forward", [("b0", 10)])]


async def test_long_prompts_take_chunks_in_turn_while_decode_steps_go_in_every_pass():
    block = FakeBlock()
    scheduler = BlockScheduler(block, max_tokens=16)
    results, decoded = {}, []
    decode = FakeCache("decode", 3)

    async def decode_steps(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        for k in range(3):
            await scheduler.forward("c", activations(1), decode, decode.length)
            decoded.append(len(block.passes))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await hand_in(scheduler, nursery, "upstream", FakeCache("running"), 1, {})
            await block.pass_running()
            for peer, name in (("a", "A"), ("b", "B")):
                await hand_in(scheduler, nursery, peer, FakeCache(name), 40, results)
            await nursery.start(decode_steps)
            block.open()
    # each decode step in the pass after its previous one, ahead of the prompts' chunks
    assert decoded == [2, 3, 4] and all(block.passes[k][1][0] == ("decode", 1) for k in (1, 2, 3))
    assert all(sum(n for _, n in held) <= 16 for _, held in block.passes)
    chunks = [name for names in block.names()[1:] for name in names if name != "decode"]
    assert chunks[:4] == ["A", "B", "A", "B"]  # the prompts take turns, chunk by chunk
    for name in "AB":
        h, out = results[name]
        assert torch.equal(out, h)


async def test_short_steps_leave_a_waiting_prompt_its_share():
    """However many sessions decode, a waiting prompt advances in every pass."""
    scheduler = BlockScheduler(FakeBlock(), max_tokens=16)  # a prompt's share: 16 / 8 = 2 tokens
    await hand_in_burst(scheduler, [("p", FakeCache("prompt"), 20)] + [(f"d{i}", FakeCache(f"d{i}"), 1) for i in range(16)])
    first, second, third = (dict(held) for _, held in scheduler.block.passes)
    assert first["prompt"] == 2 and sum(first.values()) == 16 and len(first) == 15
    assert second["prompt"] == 14 and len(second) == 3 and third == {"prompt": 4}


async def test_a_waiting_step_that_is_cancelled_leaves_its_queue():
    block = FakeBlock()
    scheduler = BlockScheduler(block, max_tokens=16)
    results = {}
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await hand_in(scheduler, nursery, "a", FakeCache("running"), 1, results)
            await block.pass_running()  # its pass runs (and waits to be let end)
            await hand_in(scheduler, nursery, "b", FakeCache("kept"), 1, results)
            async with trio.open_nursery() as inner:
                await hand_in(scheduler, inner, "c", FakeCache("cancelled"), 1, results)
                assert scheduler.waiting == 2
                inner.cancel_scope.cancel()
            assert scheduler.waiting == 1  # at once, not when the pass ends
            block.open()
    assert block.names() == [["running"], ["kept"]] and set(results) == {"running", "kept"}
    assert not scheduler._running and not scheduler.waiting


async def test_a_prompt_cancelled_between_chunks_gets_no_more_and_its_leader_hands_over():
    block = FakeBlock()
    scheduler = BlockScheduler(block, max_tokens=8)
    results = {}
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as inner:  # the prompt's session leads
                await hand_in(scheduler, inner, "a", FakeCache("prompt"), 40, results)
                await block.pass_running()
                await hand_in(scheduler, nursery, "b", FakeCache("decode"), 1, results)
                block.allow(1)
                while len(block.passes) < 2:  # the next pass runs: the decode step, the next chunk
                    await trio.sleep(0.001)
                inner.cancel_scope.cancel()
                block.open()
    assert "prompt" not in results and results["decode"][1].shape[1] == 1
    assert block.passes == [("batch", [("prompt", 8)]), ("batch", [("decode", 1), ("prompt", 7)])]
    assert not scheduler._running and not scheduler.waiting
    later = await hand_in_burst(scheduler, [("c", FakeCache("later"), 3)])
    assert later["later"][1].shape[1] == 3


async def test_a_failed_pass_fails_its_steps_and_the_scheduler_goes_on():
    block = FakeBlock(fail=("doomed",))
    scheduler = BlockScheduler(block, max_tokens=16)
    errors = []

    async def step(name, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        try:
            await scheduler.forward(name, activations(1), FakeCache(name), 0)
        except RuntimeError as e:
            errors.append((name, str(e)))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await hand_in(scheduler, nursery, "a", FakeCache("running"), 1, {})
            await block.pass_running()
            await nursery.start(step, "doomed")
            await nursery.start(step, "with-it")
            block.open()
    assert sorted(errors) == [("doomed", "out of memory"), ("with-it", "out of memory")]
    assert not scheduler._running and not scheduler.waiting
    results = await hand_in_burst(scheduler, [("a", FakeCache("after"), 3)])
    assert results["after"][1].shape[1] == 3


async def test_on_shared_says_whether_a_step_ran_with_others():
    block = FakeBlock()
    block.open()
    scheduler = BlockScheduler(block, max_tokens=16)
    shared = []

    async def step(name, n):
        await scheduler.forward(name, activations(n), FakeCache(name), 0, on_shared=lambda: shared.append(name))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(step, "x", 1)
        nursery.start_soon(step, "y", 1)
    await step("alone", 1)
    assert sorted(shared) == ["x", "y"]


async def test_a_step_not_at_its_caches_end_runs_alone_at_its_position():
    block = FakeBlock()
    scheduler = BlockScheduler(block, max_tokens=16)
    odd, results = FakeCache("odd", 5), {}
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await hand_in(scheduler, nursery, "z", FakeCache("running"), 1, {})
            await block.pass_running()
            await hand_in(scheduler, nursery, "a", FakeCache("x"), 1, results)
            await hand_in(scheduler, nursery, "b", odd, 2, results, pos=3)
            await hand_in(scheduler, nursery, "c", FakeCache("y"), 1, results)
            block.open()
    assert block.passes[1:] == [("forward", [("odd", 2)]), ("batch", [("x", 1), ("y", 1)])]
    assert odd.length == 5  # computed at positions 3 and 4


async def test_a_sub_span_sessions_steps_run_alone_in_chunks_taking_turns_with_batches():
    """A session that runs only some of the block's layers (issue 39) is never batched: its steps
    run alone, a prompt longer than the budget in chunks of the budget, and the batched passes of
    the other sessions take turns with them (neither kind waits for the other's whole backlog)."""
    block = FakeBlock()
    scheduler = BlockScheduler(block, max_tokens=16)
    sub = FakeCache("sub")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await hand_in(scheduler, nursery, "z", FakeCache("running"), 1, {})
            await block.pass_running()
            await hand_in(scheduler, nursery, "b", sub, 40, {}, layers=(2, 3))
            await hand_in(scheduler, nursery, "a", FakeCache("x"), 1, {})
            await hand_in(scheduler, nursery, "c", FakeCache("y"), 1, {})
            block.open()
    # (the pass running when they came was a batch pass: the sub-span step's turn is next)
    assert block.passes[1:] == [("forward", [("sub", 16), (2, 3)]), ("batch", [("x", 1), ("y", 1)]),
                                ("forward", [("sub", 16), (2, 3)]), ("forward", [("sub", 8), (2, 3)])]
    assert sub.length == 40  # the chunks at positions 0, 16 and 32


async def test_no_batching_runs_one_whole_step_per_pass_in_fair_turns():
    """``--batch-tokens 0``: each pass is one session's step, whole (a long prompt too), through
    ``Block.forward`` at its position; turns go round the peers (a FIFO would serve the modest
    peer last), each peer's steps in order."""
    scheduler = BlockScheduler(FakeBlock(), max_tokens=0)
    steps = [("greedy", FakeCache(f"greedy{i}"), 300 if i == 2 else 1) for i in range(6)]
    await hand_in_burst(scheduler, steps + [("modest", FakeCache("modest0"), 1)])
    passes = scheduler.block.passes
    order = [held[0][0] for _, held in passes]
    assert order == ["greedy0", "modest0", "greedy1", "greedy2", "greedy3", "greedy4", "greedy5"]
    assert all(kind == "forward" and len(held) == 1 for kind, held in passes)
    assert ("forward", [("greedy2", 300)]) in passes  # no budget: never chunked
    assert not scheduler.batching and scheduler.stats.largest == 1


async def test_no_batching_a_cancelled_waiter_passes_its_turn_on():
    block = FakeBlock()
    scheduler = BlockScheduler(block, max_tokens=0)
    results = {}
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await hand_in(scheduler, nursery, "a", FakeCache("a"), 1, results)
            await block.pass_running()
            async with trio.open_nursery() as inner:
                await hand_in(scheduler, inner, "b", FakeCache("b"), 1, results)
                inner.cancel_scope.cancel()
            await hand_in(scheduler, nursery, "c", FakeCache("c"), 1, results)
            block.open()
    assert block.names() == [["a"], ["c"]] and set(results) == {"a", "c"} and scheduler.waiting == 0


async def test_decoding_sessions_of_multi_stage_chains_go_half_a_pass_each():
    """Eight pipelined sessions' decode steps in a burst: two passes of four, so that the other
    stage of their chain computes one half while this block computes the other. Steps of
    sessions served by this block alone are not split, nor are any with the split turned off."""
    scheduler = BlockScheduler(FakeBlock(), max_tokens=64)
    steps = [("up", FakeCache(f"s{i}", 10), 1) for i in range(8)]
    await hand_in_burst(scheduler, steps, pipelined=True)
    assert scheduler.block.names() == [["s0", "s1", "s2", "s3"], ["s4", "s5", "s6", "s7"]]

    alone = BlockScheduler(FakeBlock(), max_tokens=64)
    await hand_in_burst(alone, [("up", FakeCache(f"s{i}", 10), 1) for i in range(8)])
    assert alone.block.names() == [[f"s{i}" for i in range(8)]]

    off = BlockScheduler(FakeBlock(), max_tokens=64)
    off.split = False  # (SHARDNET_SPLIT_PASSES=0)
    await hand_in_burst(off, [("up", FakeCache(f"s{i}", 10), 1) for i in range(8)], pipelined=True)
    assert off.block.names() == [[f"s{i}" for i in range(8)]]
