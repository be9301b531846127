"""Every supported family through a chain of real peers, against single-process transformers.

Each family's tiny random checkpoint switches on what makes the family differ (see
``random_model._family_extras``: sliding windows, soft-capping, multipliers, experts with shared
experts and dense first layers, MLA, attention sinks), so a block or head that skipped one would
not match. The four llama-like families are run over 1-4 peers in test_inference.py.
"""

import pytest
import torch

from shardnet.inference.client.client import Client
from shardnet.inference.model.families import FAMILIES, Family
from shardnet.inference.model.layout import split_layers
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.random_model import init_random
from shardnet.testing.helpers import (
    EXACT_NEW_TOKENS,
    EXACT_PROMPT,
    LOGIT_TOL,
    chain_last_logits,
    chain_token_ids,
    local_chain,
    transformers_model,
    transformers_reference,
)

PROMPT, NEW_TOKENS = EXACT_PROMPT, EXACT_NEW_TOKENS

NEW_FAMILIES = [f for f, fam in FAMILIES.items() if fam.tested and f not in ("llama", "mistral", "qwen2", "qwen3")]
#: bfloat16 logits of the same ops in the same order agree to rounding; allow a few ulps at |x|~10
BF16_LOGIT_TOL = 0.1


@pytest.fixture(scope="module")
def make_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made = {}

    def make(family, dtype="float32"):
        if (family, dtype) not in made:
            made[family, dtype] = init_random(root / f"{family}-{dtype}", family, layers=4, hidden=64, heads=4,
                                              kv_heads=2, vocab=512, seed=21, dtype=dtype)
        return made[family, dtype]
    return make


def test_every_new_family_is_listed():
    assert set(NEW_FAMILIES) == {"gemma2", "gemma3_text", "phi3", "olmo2", "granite", "mixtral", "qwen2_moe",
                                 "qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe"}


@pytest.mark.parametrize("peers", [2, 3])
@pytest.mark.parametrize("family", NEW_FAMILIES)
async def test_family_matches_transformers(loopback_config, make_checkpoint, family, peers):
    path = make_checkpoint(family)
    want_ids, want_logits = transformers_reference(path, PROMPT, NEW_TOKENS)
    async with local_chain(loopback_config, path, split_layers(4, peers)) as node:
        client = Client(node, LocalModel(path))
        got = await chain_token_ids(client, PROMPT, NEW_TOKENS)
        assert [(c.start, c.end) for c in client.last_stats.chain] == split_layers(4, peers)
        logits = await chain_last_logits(client, PROMPT + got)
    assert got == want_ids
    assert torch.allclose(logits, want_logits, atol=LOGIT_TOL, rtol=0), (logits - want_logits).abs().max()


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe", "deepseek_v3"])
async def test_bfloat16_checkpoint_computes_in_bfloat16(loopback_config, make_checkpoint, family):
    """dtype auto: a bf16 checkpoint runs in bf16 on every peer and the client, as transformers'
    default load does, and the peers claim bf16."""
    path = make_checkpoint(family, "bfloat16")
    assert transformers_model(path).dtype == torch.bfloat16  # the reference's own default
    want_ids, want_logits = transformers_reference(path, PROMPT, NEW_TOKENS, dtype=None)
    async with local_chain(loopback_config, path, split_layers(4, 2)) as node:
        model = LocalModel(path)
        assert model.dtype == torch.bfloat16
        client = Client(node, model)
        got = await chain_token_ids(client, PROMPT, NEW_TOKENS)
        assert {c.dtype for c in client.last_stats.chain} == {"bfloat16"}
        logits = await chain_last_logits(client, PROMPT + got)
    assert got == want_ids
    assert torch.allclose(logits, want_logits, atol=BF16_LOGIT_TOL, rtol=0), (logits - want_logits).abs().max()


@pytest.mark.parametrize("family", ["olmoe", "phimoe", "starcoder2", "cohere"])
async def test_a_family_without_its_own_test_runs_generically(loopback_config, make_checkpoint, family):
    """Families not listed as proven: the standard stack with the default (or a declared)
    adapter, checked against transformers at first load, and then exact through the chain."""
    assert not FAMILIES.get(family, Family(family)).tested
    path = make_checkpoint(family)
    want_ids, _ = transformers_reference(path, PROMPT, NEW_TOKENS)
    async with local_chain(loopback_config, path, split_layers(4, 2)) as node:
        got = await chain_token_ids(Client(node, LocalModel(path)), PROMPT, NEW_TOKENS)
    assert got == want_ids


async def test_a_bfloat16_checkpoint_runs_in_float32_when_asked(loopback_config, make_checkpoint):
    path = make_checkpoint("qwen3_moe", "bfloat16")
    want_ids, _ = transformers_reference(path, PROMPT, NEW_TOKENS)  # transformers in float32
    async with local_chain(loopback_config, path, split_layers(4, 2), dtype="float32") as node:
        client = Client(node, LocalModel(path, dtype="float32"))
        got = await chain_token_ids(client, PROMPT, NEW_TOKENS)
        assert {c.dtype for c in client.last_stats.chain} == {"float32"}
    assert got == want_ids


async def test_a_client_routes_only_through_peers_of_its_dtype(loopback_config, make_checkpoint):
    """Peers claim the dtype they compute in; a client computing in another one finds no route
    and says why."""
    from shardnet.errors import NoRouteError

    path = make_checkpoint("llama", "bfloat16")
    async with local_chain(loopback_config, path, split_layers(4, 2), dtype="float32") as node:
        client = Client(node, LocalModel(path), route_timeout=1.0)  # auto: bfloat16
        with pytest.raises(NoRouteError, match="computes in float32, not bfloat16"):
            await chain_token_ids(client, PROMPT, 2)


async def test_a_peer_without_layer_0_or_the_head_checks_its_own_layer_kinds(loopback_config, tmp_path,
                                                                               monkeypatch):
    """A block that masked sliding layers as full ones: a peer serving layers 0:2 of a model whose
    layer 0 is full attention would pass a first-layer check; a peer serving 2:4 (no layer 0, no
    head) checks its own sliding layer 3 against transformers and refuses to serve it."""
    import json

    from shardnet.errors import CheckpointError
    from shardnet.inference.server.compute_peer import serve_block
    from shardnet.transport import open_node

    path = init_random(tmp_path / "gemma2", "gemma2", layers=4, hidden=32, heads=2, kv_heads=1, vocab=128,
                       sliding_window=6)
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["full_attention", "sliding_attention"] * 2
    (path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(Family, "layer_types", lambda self, config: ["full_attention"] * config.num_hidden_layers)
    async with open_node(loopback_config()) as node:
        with pytest.raises(CheckpointError, match=r"on layer 3 .* shardnet differs from transformers"):
            async with serve_block(node, str(path), 2, 4):
                pass
