"""A peer with only its block loaded uses memory in proportion to its block."""

import psutil
import pytest

from shardnet.inference.model.checkpoint import Checkpoint
from shardnet.inference.model.random_model import init_random
from shardnet.testing.localswarm import LocalSwarm

pytestmark = pytest.mark.slow


def test_rss_grows_with_the_block_not_the_model(tmp_path):
    path = init_random(tmp_path / "big", "llama", layers=8, hidden=512, heads=8, kv_heads=8,
                       intermediate=2048, vocab=512, seed=3)
    ck = Checkpoint(path)
    layer_bytes = sum(ck.entries[n].end - ck.entries[n].start for n in ck.layer_tensors(0))
    assert layer_bytes > 15e6  # ~17 MB a layer, 134 MB for all eight
    rss = {}
    with LocalSwarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        procs = {n: swarm.spawn_node(f"p{n}", "--model", str(path), "--layers", f"0:{n}",
                                     "--kv-budget-mb", "1", command="join") for n in (1, 8)}
        for n, p in procs.items():
            swarm.wait_ready(p, 120)
            rss[n] = psutil.Process(p.pid).memory_info().rss
    grew = rss[8] - rss[1]
    print(f"RSS with 1 layer {rss[1] / 1e6:.0f} MB, with 8 layers {rss[8] / 1e6:.0f} MB; "
          f"7 layers of weights = {7 * layer_bytes / 1e6:.0f} MB")
    assert 0.6 * 7 * layer_bytes < grew < 1.6 * 7 * layer_bytes
