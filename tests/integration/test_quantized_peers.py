"""Peers that quantize their weights at load (join --quantize): they claim it, clients choose."""

import pytest
import torch

from shardnet.errors import NoRouteError
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.testing.helpers import chain_token_ids, local_chain

PROMPT = [3, 17, 42, 99, 7, 250, 11]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return init_random(tmp_path_factory.mktemp("q") / "qwen3_moe", "qwen3_moe", layers=4, hidden=128, heads=4,
                       kv_heads=2, vocab=512, seed=3, dtype="bfloat16")


def quantized_greedy(path, mode, new):
    """Greedy tokens of the whole model quantized the same way, in this process."""
    from shardnet.inference.model.block import Block, Head
    from shardnet.inference.model.checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    head, block = Head(ckpt, dtype=torch.bfloat16), Block(ckpt, 0, 4, dtype=torch.bfloat16, quantize=mode)
    cache, feed, pos, out = block.new_cache(), PROMPT, 0, []
    for _ in range(new):
        logits = head.logits(block.forward(head.embed(torch.tensor([feed])), cache, pos))
        pos += len(feed)
        feed = [int(logits[0, -1].argmax())]
        out += feed
    return out


@pytest.mark.parametrize("mode", ["int8", "int4"])
async def test_quantized_spans_are_claimed_and_chosen_by_the_client(loopback_config, moe, mode):
    """A chain of quantized peers computes what the model quantized in one process computes."""
    want = quantized_greedy(moe, mode, 8)
    async with local_chain(loopback_config, moe, [(0, 2), (2, 4)], quantize=mode) as node:
        client = Client(node, LocalModel(moe), quantized="require")
        got = await chain_token_ids(client, PROMPT, 8)
        assert {c.quant for c in client.last_stats.chain} == {mode}
        assert got == want
        with pytest.raises(NoRouteError, match=r"is quantized \(" + mode):
            await chain_token_ids(Client(node, LocalModel(moe), quantized="refuse", route_timeout=1.0), PROMPT, 2)


async def test_a_client_requiring_quantized_spans_does_not_take_plain_ones(loopback_config, moe):
    async with local_chain(loopback_config, moe, [(0, 4)]) as node:
        with pytest.raises(NoRouteError, match="is not quantized"):
            await chain_token_ids(Client(node, LocalModel(moe), quantized="require", route_timeout=1.0), PROMPT, 2)
