"""A 32k-token prompt through 2 peers (issue 35, "Long prompts"): each peer's block scheduler
prefills it in chunks of its token budget, with other sessions' decode steps in the passes
between its chunks. The long session's greedy output equals single-process transformers in
float32; short sessions started while it prefilled get all their tokens before its first; and
each peer's KV budget holds exactly ``max_len`` positions of every open session."""

import pytest
import trio

from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.testing.factories import random_prompts
from shardnet.testing.helpers import local_chain, transformers_reference

pytestmark = pytest.mark.slow

LONG = 32768  # prompt tokens of the long session
NEW = 8  # its new tokens
SHORTS, SHORT_NEW = 3, 6  # short sessions started while it prefills, and their new tokens
BUDGET = 256  # each peer's token budget per forward pass (join --batch-tokens)
LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 4, 64, 4, 2, 512


async def test_a_32k_prompt_prefills_in_chunks_while_short_sessions_decode(loopback_config, tmp_path):
    path = init_random(tmp_path / "llama-32k", "llama", layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                       kv_heads=KV_HEADS, vocab=VOCAB, seed=5, max_positions=LONG + 256)
    long_prompt = random_prompts(1, seed=3, vocab=VOCAB, lengths=(LONG, LONG))[0]
    shorts = random_prompts(SHORTS, seed=4, vocab=VOCAB, lengths=(4, 16))
    served = []
    got: dict[str, list[int]] = {}
    first_long_token = last_short_token = None
    async with local_chain(loopback_config, path, [(0, 2), (2, 4)], served=served, dtype="float32",
                           batch_tokens=BUDGET) as node:
        client = Client(node, LocalModel(path, dtype="float32"), audit_rate=0.0)
        # per token: keys and values of 2 layers, KV_HEADS heads of HIDDEN / HEADS floats each
        kv_per_token = 2 * 2 * KV_HEADS * (HIDDEN // HEADS) * 4
        assert [s.block.kv_bytes_per_token() for s in served] == [kv_per_token] * 2
        started, all_started, resume = 0, trio.Event(), trio.Event()

        async def long_session() -> None:
            nonlocal first_long_token
            got["long"] = []
            async for tok in client.generate(long_prompt, max_new_tokens=NEW, stop_at_eos=False):
                first_long_token = first_long_token or trio.current_time()
                got["long"].append(tok.id)

        async def short_session(i: int) -> None:
            nonlocal started, last_short_token
            got[i] = []
            async for tok in client.generate(shorts[i], max_new_tokens=SHORT_NEW, stop_at_eos=False):
                got[i].append(tok.id)
                last_short_token = trio.current_time()
                if len(got[i]) == 1:  # every session open on both peers: the budget is checked then
                    started += 1
                    if started == SHORTS:
                        all_started.set()
                    await resume.wait()

        with trio.fail_after(900):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_session)
                while served[0].scheduler.stats.tokens < 4 * BUDGET:  # the first peer is prefilling it
                    await trio.sleep(0.05)
                for i in range(SHORTS):
                    nursery.start_soon(short_session, i)
                await all_started.wait()
                # (c) each peer's KV budget holds max_len positions (prompt + new + 1) of each open session
                max_lens = [len(p) + n + 1 for p, n in [(long_prompt, NEW)] + [(s, SHORT_NEW) for s in shorts]]
                for s in served:
                    assert sorted(s.kv.sessions.values()) == sorted(m * kv_per_token for m in max_lens)
                    assert s.kv.used == sum(max_lens) * kv_per_token
                assert "long" in got and not got["long"]  # still prefilling
                resume.set()
            # every session ended: its KV budget is free again
            while any(s.kv.used for s in served):
                await trio.sleep(0.05)
        stats = [s.scheduler.stats for s in served]
    # (b) the short sessions decoded to their last token while the long prompt was still prefilling
    assert last_short_token < first_long_token
    # each peer ran the long prompt in chunks within its budget: >= LONG / BUDGET passes
    assert all(s.passes >= LONG // BUDGET and s.tokens <= s.passes * BUDGET for s in stats), stats
    assert all(s.largest > 1 for s in stats[:1]), stats  # decode steps shared passes with its chunks
    # (a) greedy output equals single-process transformers in float32
    assert got["long"] == transformers_reference(path, long_prompt, NEW)[0]
    for i, p in enumerate(shorts):
        assert got[i] == transformers_reference(path, p, SHORT_NEW)[0], i
