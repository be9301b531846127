"""The client's LM head batched across sessions (shardnet/inference/client/head_batcher.py), on the
shipped tiny-llama's real head."""

import pytest
import torch
import trio

from shardnet.inference.client.head_batcher import HeadBatcher


@pytest.fixture(scope="module")
def head():
    from shardnet.inference.model.local_model import LocalModel
    from shardnet.models import default_model_path

    return LocalModel(default_model_path(), dtype="float32").head


def _hidden(head, seed, tokens):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, head.config.hidden_size, generator=g)


def test_one_request_alone_is_the_heads_own_answer(head):
    h = _hidden(head, 0, 3)
    got = trio.run(HeadBatcher(head).logits, h)
    assert torch.equal(got, head.logits(h)[0])


def test_requests_woken_together_are_one_computation_with_each_sessions_rows(head):
    batcher = HeadBatcher(head)
    hiddens = [_hidden(head, i, 1 + i % 3) for i in range(16)]
    got = {}

    async def main():
        burst = trio.Event()

        async def session(i):
            await burst.wait()
            got[i] = await batcher.logits(hiddens[i])

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(session, i)
            await trio.sleep(0.01)
            burst.set()

    trio.run(main)
    assert batcher.stats.calls == 1 and batcher.stats.requests == 16 and batcher.stats.largest == 16
    for i, h in enumerate(hiddens):
        want = head.logits(h)[0]
        assert got[i].shape == want.shape
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)  # float32: order of sums only


def test_a_cancelled_request_is_taken_back_and_the_others_are_answered(head):
    batcher = HeadBatcher(head)
    got = {}

    async def main():
        burst = trio.Event()

        async def session(i, cancel=False):
            await burst.wait()
            with trio.CancelScope() as scope:
                if cancel:
                    scope.cancel()  # it queues its request, then is cancelled at the checkpoint
                got[i] = await batcher.logits(_hidden(head, i, 2))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(session, 0)
            nursery.start_soon(session, 1, True)
            nursery.start_soon(session, 2)
            await trio.sleep(0.01)
            burst.set()

    trio.run(main)
    assert set(got) == {0, 2} and batcher._waiting == []


def test_an_error_reaches_every_request_of_its_computation(head):
    batcher = HeadBatcher(head)
    errors = []

    async def main():
        burst = trio.Event()

        async def session(h):
            await burst.wait()
            try:
                await batcher.logits(h)
            except RuntimeError as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(session, _hidden(head, 0, 1))
            nursery.start_soon(session, torch.zeros(1, 1, 7))  # the wrong width
            await trio.sleep(0.01)
            burst.set()

    trio.run(main)
    assert len(errors) == 2 and batcher._waiting == []


def test_a_slow_head_runs_in_a_thread_and_requests_meanwhile_make_the_next_computation(head):
    """The event loop runs on while a slow head computes (here: until the test lets it finish);
    the requests that came in during it are one computation after it."""
    import threading

    class HeldHead:
        def __init__(self):
            self.go = threading.Event()

        def logits(self, hidden):
            assert self.go.wait(10)
            return head.logits(hidden)

    held = HeldHead()
    batcher = HeadBatcher(held)
    batcher._in_thread = True  # (a computation took longer than THREAD_AFTER_S)
    hiddens = [_hidden(head, i, 2) for i in range(6)]
    got = {}

    async def main():
        async def session(i):
            got[i] = await batcher.logits(hiddens[i])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(session, 0)
            while batcher._busy is None:  # its computation starts in a thread
                await trio.sleep(0)
            for i in range(1, 6):
                nursery.start_soon(session, i)
            await trio.sleep(0.05)  # the loop runs on meanwhile: they queue
            assert len(batcher._waiting) == 5
            held.go.set()

    trio.run(main)
    assert batcher.stats.calls == 2 and batcher.stats.largest == 5
    for i, h in enumerate(hiddens):
        torch.testing.assert_close(got[i], head.logits(h)[0], rtol=1e-5, atol=1e-5)
