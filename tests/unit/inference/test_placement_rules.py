"""Automatic block placement and rebalancing: the rules, sans-IO (the processes that follow them
are tests/system/test_placement.py)."""

import random
from functools import partial

import pytest
import torch

from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.server.placement import (
    affordable_layers,
    best_window,
    coverage,
    layer_bytes,
    peer_rank,
    plan_move,
    served_throughput,
    spread_window,
    window_fills,
)
from shardnet.models import default_model_path
from shardnet.testing import factories
from shardnet.transport.errors import ShardnetError


claim = partial(factories.claim, kv_tokens=100, expires=4e9)


def test_memory_decides_how_many_layers():
    ckpt = Checkpoint(default_model_path())
    per = layer_bytes(ckpt, 0, "float32")
    assert per == 2 * layer_bytes(ckpt, 0, "float16") > 0
    assert affordable_layers(ckpt, "float32", 100 * per) == ckpt.num_layers  # everything fits
    assert affordable_layers(ckpt, "float32", int(3.9 / 0.8 * per)) == 3
    assert affordable_layers(ckpt, "float32", 100 * per, max_layers=2) == 2
    with pytest.raises(ShardnetError, match="not enough memory for one layer"):
        affordable_layers(ckpt, "float32", 10 * per, reserve_bytes=10 * per)


def test_a_joining_peer_takes_the_least_served_window_and_packs_against_its_neighbours():
    rng = random.Random(0)
    assert best_window([0.0] * 8, 3, rng=rng) in ((0, 3), (5, 8))  # flush with an end, never 2:5
    served = served_throughput([claim(start=0, end=3, peer="a")], 8)
    for seed in range(20):  # right after the served layers, or flush with the end: no 1-layer gap
        assert best_window(served, 3, rng=random.Random(seed)) in ((3, 6), (5, 8))
    served = served_throughput([claim(start=0, end=3, peer="a"), claim(start=5, end=8, peer="b")], 8)
    assert best_window(served, 2) == (3, 5)
    # all served once: the window whose weakest layers are weakest
    served = served_throughput([claim(start=0, end=8, peer="a", tput=10), claim(start=0, end=4, peer="b", tput=10)], 8)
    assert best_window(served, 4) == (4, 8)


def test_peers_choosing_at_once_from_the_same_empty_swarm_spread_over_a_tiling_of_it():
    # the windows to take on an empty swarm: a tiling (best_window takes 0:2 or 6:8 alone)
    assert window_fills([0.0] * 8, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert window_fills([0.0] * 8, 3) == [(0, 3), (3, 6), (5, 8)]  # every layer in some window
    # 24 peers (fixed IDs) that see the same empty swarm: by their IDs' hashes, each window taken
    # by a few (independent draws: 6 +- 2 each for 41% of random sets of 24 IDs, every window
    # taken for 99.6%); here 6, 8, 4, 6
    peers = [f"12D3KooWpeer{i}" for i in range(24)]
    spans = [spread_window([0.0] * 8, 2, p) for p in peers]
    assert sorted(spans.count(w) for w in window_fills([0.0] * 8, 2)) == [4, 6, 6, 8]
    # one peer is the same each time it looks, and keeps a span still among those to take
    assert all(spread_window([0.0] * 8, 2, p) == s for p, s in zip(peers, spans))
    assert spread_window([0.0] * 8, 2, peers[0], keep=(4, 6)) == (4, 6)
    assert peer_rank("a") == peer_rank("a") != peer_rank("b")


def test_a_joiner_takes_a_window_as_needy_as_the_neediest():
    half_served = [100.0] * 4 + [0.0] * 4
    assert {spread_window(half_served, 4, f"p{i}") for i in range(20)} == {(4, 8)}
    assert spread_window(half_served, 4, "p", keep=(0, 4)) == (4, 8)  # a span no longer to take is left
    # the uneven spans of a 24-peer run (5, 13, 3, 3 peers): the two thinnest, never 0:2 or 2:4
    uneven = [5.0, 5.0, 13.0, 13.0, 3.0, 3.0, 3.0, 3.0]
    assert window_fills(uneven, 2) == [(4, 6), (6, 8)]
    assert {spread_window(uneven, 2, f"p{i}") for i in range(20)} == {(4, 6), (6, 8)}
    # 0:2 and 6:8 served: the two windows between them, each with an unserved layer
    assert window_fills([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0], 2) == [(2, 4), (4, 6)]


def test_a_peer_moves_only_when_it_raises_the_bottleneck_and_never_leaves_a_gap():
    a, b, c = claim(start=0, end=4, peer="a"), claim(start=4, end=8, peer="b"), claim(start=0, end=4, peer="c")
    fixed = claim(start=0, end=4, peer="fixed")
    # a is the only server of 0..3 (b and c absent): it stays whatever it would gain
    assert plan_move([a], a, 8) is None
    # 0..3 served three times, 4..7 once: a (or c) should move to 4..8
    move = plan_move([a, b, c, fixed], a, 8)
    assert (move.start, move.end) == (4, 8) and move.bottleneck_after == 2 * move.bottleneck_now
    # balanced already: moving gains nothing
    assert plan_move([a, b, c, claim(start=4, end=8, peer="d")], a, 8) is None
    # a gap (4..7 unserved) is filled by a peer whose layers others also serve
    move = plan_move([a, c], a, 8)
    assert (move.start, move.end) == (4, 8) and move.bottleneck_now == 0
    # a small gain within the margin is not worth a move
    assert plan_move([claim(start=0, end=4, peer="a", tput=10), claim(start=4, end=8, peer="b", tput=9.5), claim(start=0, end=4, peer="c", tput=10)],
                     claim(start=0, end=4, peer="a", tput=10), 8, margin=0.2) is None


def test_coverage_map():
    rows = coverage([claim(start=0, end=4, peer="a", tput=5), claim(start=2, end=8, peer="b", tput=7)], 8)
    assert [len(r["peers"]) for r in rows] == [1, 1, 2, 2, 1, 1, 1, 1]
    assert rows[3]["tput"] == 12


def test_memory_for_mixture_of_experts_layers_counts_every_expert(tmp_path):
    """DeepSeek-style: a dense first layer, then layers of 8 experts plus a shared one. The
    estimate is what loading really takes, and a peer takes as many MoE layers as fit."""
    from shardnet.inference.model.block import Block
    from shardnet.inference.model.random_model import init_random

    ckpt = Checkpoint(init_random(tmp_path / "moe", "deepseek_v3", layers=5, hidden=64, heads=4, vocab=128,
                                  experts=8, active_experts=2))
    dense, moe = layer_bytes(ckpt, 0, "float32"), layer_bytes(ckpt, 1, "float32")
    assert moe > dense
    for i in (0, 1):
        assert Block(ckpt, i, i + 1).load_report.bytes == layer_bytes(ckpt, i, "float32")

    def free_for(weights):  # what a peer must have free to spend ``weights`` on them
        return int(weights / 0.8) + 1

    assert affordable_layers(ckpt, "float32", free_for(3 * moe + dense // 2)) == 3
    assert affordable_layers(ckpt, "float32", free_for(2 * moe + dense // 2)) == 2
    assert affordable_layers(ckpt, "float32", free_for(moe + dense // 2)) == 1  # 2 layers fit at the dense end only


@pytest.mark.parametrize("mode, share", [("int8", 0.5), ("int4", 0.3)])
def test_quantized_layers_are_planned_at_their_quantized_size(tmp_path, mode, share):
    """The estimate for a quantized layer is close to what quantizing it really leaves."""
    from shardnet.inference.model.block import Block
    from shardnet.inference.model.quantize import weight_bytes
    from shardnet.inference.model.random_model import init_random

    ckpt = Checkpoint(init_random(tmp_path / "m", "llama", layers=2, hidden=256, heads=4, vocab=128,
                                  dtype="bfloat16"))
    plain = layer_bytes(ckpt, 0, "bfloat16")
    planned = layer_bytes(ckpt, 0, "bfloat16", quantize=mode)
    real = weight_bytes(Block(ckpt, 0, 1, dtype=torch.bfloat16, quantize=mode).layers[0])
    assert planned < share * plain * 1.25
    assert abs(planned - real) < 0.1 * real, (planned, real)


def test_a_peer_moves_to_fill_one_of_several_gaps():
    # layers 2 and 6 are unserved: no move of one peer lifts the bottleneck off zero, but filling
    # one of them is progress (before, two far-apart gaps were never filled)
    a = claim(start=0, end=2, peer="a")
    b = claim(start=0, end=2, peer="b")
    c = claim(start=3, end=6, peer="c")
    d = claim(start=7, end=8, peer="d")
    move = plan_move([a, b, c, d], a, 8)
    assert move is not None and (move.start <= 2 < move.end or move.start <= 6 < move.end)
    assert plan_move([a, c, d], a, 8) is None  # the only server of 0:2 stays


def test_placement_counts_peers_where_they_will_be():
    from dataclasses import replace

    from shardnet.inference.server.placement import fillable_gap, planned_throughput

    serving = claim(start=0, end=4, peer="a", tput=10.0)
    moving = replace(claim(start=0, end=4, peer="b", tput=30.0), loading=(4, 8))
    joining = replace(claim(start=4, end=8, peer="c", tput=0.0), loading=(4, 8))
    assert served_throughput([serving, moving, joining], 8) == [40.0] * 4 + [0.0] * 4
    # the mover at its new span; the joiner, not measured yet, as the measured peers' mean (20)
    assert planned_throughput([serving, moving, joining], 8) == [10.0] * 4 + [50.0] * 4
    # a gap someone is loading is no gap to fill
    assert fillable_gap([serving, claim(start=0, end=4, peer="d")], 0, 4, 8)
    assert not fillable_gap([serving, claim(start=0, end=4, peer="d"), joining], 0, 4, 8)
    # the last server of a layer stays while another only loads it
    me = claim(start=4, end=8, peer="me", tput=10.0)
    assert plan_move([serving, replace(claim(start=4, end=8, peer="e", tput=0.0), loading=(4, 8)), me], me, 8) is None


def test_a_peer_does_not_leave_a_layer_whose_other_server_is_moving_off_it():
    from dataclasses import replace

    me = claim(start=0, end=4, peer="me", tput=10.0)
    other = claim(start=0, end=4, peer="o", tput=10.0)
    far = claim(start=4, end=8, peer="f", tput=5.0)
    assert plan_move([other, far, me], me, 8) is not None  # 'o' stays on 0:4: we may go
    leaving = replace(other, loading=(4, 8))
    assert plan_move([leaving, far, me], me, 8) is None  # 'o' is loading 4:8: we stay
