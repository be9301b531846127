"""Speculative decoding through a chain: greedy output identical to plain greedy decoding."""

from contextlib import AsyncExitStack

import pytest
import torch

from shardnet.inference.client.client import Client
from shardnet.inference.client.speculative import (
    ModelDrafter,
    NGramDrafter,
    accept_greedy,
)
from shardnet.inference.client.suffix_drafter import SuffixDrafter
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.model.local_session import LocalSession
from shardnet.inference.server.compute_peer import serve_block
from shardnet.models import default_draft_path, default_model_path
from shardnet.testing.helpers import local_chain
from shardnet.transport import open_node

PROMPT = "def __init__(self, name):\n        self.name = name\n        self."
NEW = 40


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5], [4, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def test_ngram_drafter_continues_a_repeated_pattern():
    d = NGramDrafter()
    assert d.propose([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert d.propose([1, 2, 3], 2) == []


def test_model_drafter_follows_the_accepted_text():
    d = ModelDrafter(default_draft_path())
    ids = LocalModel(default_model_path()).encode("import os\nimport ")
    first = d.propose(ids, 4)
    again = d.propose(ids, 4)  # same text: same proposals from the rolled-back cache
    assert first == again and len(first) == 4
    longer = d.propose(ids + first[:2], 3)
    assert longer[:2] == first[2:4]  # greedy: the continuation of an accepted prefix is unchanged


def drafter_of_kind(kind: str, model: LocalModel):
    if kind == "ngram":
        return NGramDrafter()
    if kind == "suffix":
        return SuffixDrafter()
    return ModelDrafter(default_draft_path(), vocab_size=model.ckpt.config.vocab_size)


@pytest.mark.parametrize("drafter_kind,k", [("ngram", 1), ("ngram", 4), ("suffix", 4), ("model", 1), ("model", 3),
                                            ("model", 6)])
async def test_speculative_greedy_equals_plain_greedy(loopback_config, reference, drafter_kind, k):
    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 4), (4, 8)]) as node:
        model = LocalModel(path)
        drafter = drafter_of_kind(drafter_kind, model)
        client = Client(node, model)
        got = [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False,
                                                    drafter=drafter, k=k)]
    assert got == reference
    spec = client.last_stats.speculation
    assert spec.verified < NEW  # fewer chain traversals than tokens
    if drafter_kind == "model":
        assert spec.acceptance > 0.2, spec  # the shipped draft agrees with its target fairly often


@pytest.mark.parametrize("k", [6, None])
async def test_tree_speculation_greedy_equals_plain_greedy(loopback_config, reference, k):
    """Trees of drafts (the draft's chain and its second choices) through two peers: the output
    is plain greedy decoding's. A fixed shape (a chain of 6 and 6 branches): every traversal
    verified a tree, and some kept a branch's token; a shape chosen per tree (the default, by
    ``TreeShaper`` from the measured acceptance and trips): the first is 4 + 4."""
    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 4), (4, 8)]) as node:
        model = LocalModel(path)
        client = Client(node, model)
        got = [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False,
                                                    drafter=drafter_of_kind("model", model), k=k, tree=True,
                                                    branches=k)]
    assert got == reference
    spec = client.last_stats.speculation
    assert spec.verified < NEW and spec.trees > 0
    if k is not None:
        assert spec.drafted > k * spec.verified  # branches went along with the chains
        assert spec.branched > 0  # and some traversal kept a branch's token (the peers kept that path)


async def test_a_trees_logprobs_are_plain_decodings_and_penalties_keep_chains(loopback_config):
    """With trees, each token's log-probability comes from the row it was chosen at (a branch's
    parent's, not the chain's row at that depth): as plain decoding reports them. With a
    frequency penalty (which counts the tokens before each position) chains are sent instead.
    In float32, where the two computations agree to ~1e-5."""
    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 4), (4, 8)], dtype="float32") as node:
        model = LocalModel(path, dtype="float32")
        client = Client(node, model, audit_rate=0)
        draft = drafter_of_kind("model", model)
        plain = [t async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False, logprobs=2)]
        tree = [t async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False, logprobs=2,
                                                 drafter=draft, k=6, branches=6)]
        spec = client.last_stats.speculation
        assert spec.trees > 0 and spec.branched > 0
        assert [t.id for t in tree] == [t.id for t in plain]
        for a, b in zip(tree, plain):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [x for x, _ in a.top_logprobs] == [x for x, _ in b.top_logprobs]
        penalised = [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False,
                                                         frequency_penalty=0.5, drafter=draft, k=6)]
        assert client.last_stats.speculation.trees == 0
        assert penalised == [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False,
                                                                 frequency_penalty=0.5)]


# -- lossless sampling -----------------------------------------------------------------------------
def chi2_homogeneity(a: dict, b: dict) -> tuple[float, int]:
    """Two-sample chi-square statistic over the union of outcomes (rare ones pooled), and its
    degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda x: -(a.get(x, 0) + b.get(x, 0)))
    cells, pool = [], [0, 0]
    for key in keys:
        ca, cb = a.get(key, 0), b.get(key, 0)
        if (ca + cb) * min(na, nb) / (na + nb) < 5:  # expected count under 5: pool it
            pool[0] += ca
            pool[1] += cb
        else:
            cells.append((ca, cb))
    if sum(pool):
        cells.append(tuple(pool))
    stat = 0.0
    for ca, cb in cells:
        tot = ca + cb
        for obs, n in ((ca, na), (cb, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(cells) - 1


def chi2_pvalue(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    from shardnet.inference.model.random_model import init_random

    root = tmp_path_factory.mktemp("spec-sample")
    target = init_random(root / "t", "llama", layers=2, hidden=32, heads=2, kv_heads=1, vocab=12, seed=21)
    draft = init_random(root / "d", "llama", layers=1, hidden=32, heads=2, kv_heads=1, vocab=12, seed=22)
    return target, draft


InProcessSession = LocalSession


async def _sample_locally(target, draft, n, *, k=3, depth=1, speculate=True, new=4, last=2, accept=None,
                          drop_stale=None):
    """The last ``last`` of ``new`` tokens sampled with seeds 0..n-1, through the client's decode loop
    (generate_on: drafting, chunks in flight, acceptance, fencing) over an in-process session.
    The first token comes from the prefill; the later ones from verify chunks."""
    from collections import Counter

    from shardnet.inference.client import decode as client_mod
    from shardnet.inference.client.decode import GenerationStats, generate_on
    from shardnet.inference.client.sampling import Randomness, SamplingParams
    from shardnet.inference.model.block import Block

    model = LocalModel(target)
    block = Block(model.ckpt, 0, model.ckpt.num_layers)
    drafter = ModelDrafter(draft, vocab_size=12) if speculate else None
    params = SamplingParams(temperature=1.0)
    prompt = [3, 1, 4]
    counts = Counter()
    real_accept = client_mod.accept_sampled
    client_mod.accept_sampled = accept or real_accept
    try:
        with torch.inference_mode():
            for seed in range(n):
                # by default, both ways of losing stale chunks
                sess = InProcessSession(block, drop_stale=seed % 2 == 0 if drop_stale is None else drop_stale)
                got = [t.id async for t in generate_on(
                    sess, model, prompt, params=params, rng=Randomness(seed), drafter=drafter, k=k, depth=depth,
                    max_new=new, stop_at_eos=False, stats=GenerationStats())]
                counts[tuple(got[-last:])] += 1
    finally:
        client_mod.accept_sampled = real_accept
    return counts


async def test_seeded_sampling_does_not_depend_on_which_stale_chunks_were_dropped(small_models):
    """Whether a peer drops a stale chunk depends on timing; the numbers a seed gives must not."""
    target, draft = small_models
    a = await _sample_locally(target, draft, 40, k=2, depth=3, drop_stale=True, new=8, last=8)
    b = await _sample_locally(target, draft, 40, k=2, depth=3, drop_stale=False, new=8, last=8)
    assert a == b and len(a) > 10  # 40 seeds: many different continuations, each the same both ways


_PLAIN: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("k,depth", [(3, 1), (1, 3)])
async def test_speculative_sampling_has_the_target_distribution(small_models, k, depth):
    """Threshold: with N = 2000 seeded samples per side, the two-sample chi-square test on the
    joint distribution of the 3rd and 4th sampled tokens (144 outcomes, rare ones pooled) rejects
    equal distributions at p < 0.001 by chance once in a thousand runs; and the same test must
    reject a deliberately wrong acceptance rule (keep every draft), so it has the power to see
    a broken sampler. Runs through the client's decode loop, with one verify chunk at a time and
    with several in flight (drafts of later chunks assume earlier ones are accepted whole)."""
    from shardnet.inference.client.sampling import draw

    target, draft = small_models
    if "plain" not in _PLAIN:
        _PLAIN["plain"] = await _sample_locally(target, draft, 2000, speculate=False)
    plain = _PLAIN["plain"]
    spec = await _sample_locally(target, draft, 2000, k=k, depth=depth)
    stat, dof = chi2_homogeneity(plain, spec)
    assert chi2_pvalue(stat, dof) > 1e-3, (stat, dof)

    def keep_all(drafts, q, p, rng, start):  # wrong: ignores p entirely
        return drafts + [draw(p[len(drafts)], rng.uniform(start + len(drafts), "target"))]

    broken = await _sample_locally(target, draft, 2000, k=k, depth=depth, accept=keep_all)
    stat, dof = chi2_homogeneity(plain, broken)
    assert chi2_pvalue(stat, dof) < 1e-6, (stat, dof)


@pytest.mark.parametrize("depth", [1, 3])
async def test_speculative_sampling_through_the_chain_is_seeded(loopback_config, depth):
    path = default_model_path()
    async with AsyncExitStack() as stack:
        peer = await stack.enter_async_context(open_node(loopback_config()))
        await stack.enter_async_context(serve_block(peer, str(path), 0, 8))
        node = await stack.enter_async_context(open_node(loopback_config()))
        await node.connect(peer.listen_addrs[0])
        from shardnet.inference.claims import fetch_claims

        model = LocalModel(path)
        client = Client(node, model, route=await fetch_claims(node, str(peer.peer_id)))
        drafter = ModelDrafter(default_draft_path(), vocab_size=model.ckpt.config.vocab_size)

        async def run(seed):
            return [t.id async for t in client.generate(PROMPT, max_new_tokens=24, temperature=0.8, top_k=40,
                                                        seed=seed, stop_at_eos=False, drafter=drafter, k=3,
                                                        depth=depth)]

        a, b, c = await run(1), await run(1), await run(2)
    assert a == b and a != c and len(a) == 24
    assert client.last_stats.speculation.verified < 24
    if depth == 1:  # one chunk at a time: trees of sampled drafts (accept_sampled_tree), seeded as well
        assert client.last_stats.speculation.trees > 0


def test_a_sampled_tree_is_the_sampled_chain_and_second_draws_beside_it(small_models):
    from shardnet.inference.client.sampling import Randomness, SamplingParams

    target, draft = small_models
    drafter = ModelDrafter(draft, vocab_size=12)
    params, ids = SamplingParams(temperature=1.0), [3, 1, 4]
    chain, q = drafter.sample(ids, 4, params, Randomness(7), 12)
    drafter.forget()
    tokens, parents, q_tree = drafter.sample_tree(ids, 4, 2, params, Randomness(7), 12)
    assert tokens[:4] == chain and parents == [-1, 0, 1, 2, -1, 0]
    assert torch.equal(q_tree[:4], q) and torch.equal(q_tree[4:], q[:2])  # a branch: its chain draft's distribution


# -- activation compression -------------------------------------------------------------------------
@pytest.mark.parametrize("wire,identical", [("float16", NEW), ("bfloat16", NEW), ("int8q", 16)])
async def test_compressed_activations(loopback_config, reference, wire, identical):
    """Measured on the shipped model (docs/benchmarks.md): float16 and bfloat16 leave greedy output
    unchanged; int8 with per-position scales changes it after a while (here not in 16 tokens)."""
    from shardnet.inference.model import wire as wire_mod

    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 4), (4, 8)]) as node:
        client = Client(node, LocalModel(path), wire=wire)
        got = [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False)]
    assert got[:identical] == reference[:identical]
    hidden = torch.randn(1, 1, 224)
    sizes = {w: len(wire_mod.to_payload(hidden, w)[2]) for w in ("float32", wire)}
    assert sizes[wire] <= sizes["float32"] // 2
    restored = wire_mod.from_message(_as_message(*wire_mod.to_payload(hidden, wire)))
    assert torch.allclose(restored.float(), hidden, atol=0.05, rtol=0.02)


def _as_message(dtype, shape, payload):
    from shardnet.protocols import activation as ap

    return ap.decode_frame(ap.encode(ap.Step(b"x" * 16, n=0, pos=0, dtype=dtype, shape=shape, payload=payload))[4:])


@pytest.mark.parametrize("drafter_kind,k,depth", [("ngram", 2, 2), ("model", 1, 3), ("model", 3, 2),
                                                  ("model", 4, 4), ("ngram", 4, 3), ("suffix", 4, 3)])
async def test_pipelined_verify_chunks_keep_greedy_output(loopback_config, reference, drafter_kind, k, depth):
    path = default_model_path()
    async with local_chain(loopback_config, path, [(0, 3), (3, 5), (5, 8)]) as node:
        model = LocalModel(path)
        drafter = drafter_of_kind(drafter_kind, model)
        client = Client(node, model)
        got = [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False,
                                                    drafter=drafter, k=k, depth=depth)]
    assert got == reference


async def test_speculation_across_emulated_wan_edges(loopback_config, reference):
    """Every peer behind a WAN emulator (it announces the proxy's address), so each connection
    crosses a delayed, jittery, rate-capped edge: output still identical, chunks in flight."""
    import trio

    from bench.wan_emulator import Link, WanProxy
    from shardnet.testing.helpers import free_port

    path = default_model_path()
    link = Link(delay=0.01, jitter=0.003, rate=20e6)
    async with trio.open_nursery() as nursery:  # the proxies outlive every node
        async with AsyncExitStack() as stack:
            async def behind_wan(seed, **kw):
                real, pub = free_port(), free_port()
                await nursery.start(WanProxy(("127.0.0.1", real), link, seed=seed, port=pub).serve)
                return await stack.enter_async_context(open_node(loopback_config(
                    listen=[f"/ip4/127.0.0.1/tcp/{real}"], announce=[f"/ip4/127.0.0.1/tcp/{pub}"],
                    low_watermark=0, **kw)))

            boot = await behind_wan(0)
            boot_addr = [str(boot.listen_addrs[0])]
            for i, (a, b) in enumerate(((0, 4), (4, 8))):
                peer = await behind_wan(i + 1, bootstrap=boot_addr)
                await stack.enter_async_context(serve_block(peer, str(path), a, b))
            node = await behind_wan(9, bootstrap=boot_addr)
            await node.wait_bootstrapped()
            model = LocalModel(path)
            client = Client(node, model)
            route = await client.planner.find_route()
            assert await node.ping(route[0].peer) >= 0.02  # two delayed edges: really through the WAN
            drafter = ModelDrafter(default_draft_path(), vocab_size=model.ckpt.config.vocab_size)
            got = [t.id async for t in client.generate(PROMPT, max_new_tokens=NEW, stop_at_eos=False,
                                                        drafter=drafter, k=2, depth=3)]
        nursery.cancel_scope.cancel()
    assert got == reference
