"""The swarm simulator (bench/swarm_sim) at 100 peers for a simulated hour: the invariants that
must hold whatever the world model's numbers, checked on shardnet's own placement and routing.

- no layer stays unserved longer than the healing bound while some peer could move to it;
- what requests get never exceeds the max flow of the placement, nor that the LP bound;
- the simulator runs without torch (it drives the pure placement and routing code).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.swarm_sim.models import MODELS
from bench.swarm_sim.policies import make
from bench.swarm_sim.sim import Sim
from shardnet.inference.server.placement import DEFAULT_REBALANCE_INTERVAL

ROOT = Path(__file__).resolve().parents[2]


def healing_bound(sim: Sim) -> float:
    """The longest a layer may stay unserved while spare capacity exists: a look at the swarm
    (the upkeep interval, jittered by up to 25%), a turn behind the peers on the same span, and
    the slowest load of the new layers at the slowest downlink."""
    slowest = min(p.downlink_mbs for p in sim.swarm.peers.values())
    load = max(sim.model.layer_bytes(i) for i in range(sim.model.num_layers)) * max(
        p.n_layers for p in sim.swarm.peers.values()) / (slowest * 1e6) + 5.0
    return 1.25 * DEFAULT_REBALANCE_INTERVAL * 3 + load


@pytest.mark.parametrize("model", ["llama-70b", "deepseek-v3"])
def test_a_simulated_hour_of_100_peers_keeps_the_invariants(model):
    sim = Sim(model=MODELS[model], policy=make("shardnet"), peers=100, hours=1.0, seed=7, load=0.3)
    stats = sim.run()
    assert stats.joins >= 100 and stats.leaves > 0  # churn happened
    assert stats.samples, "nothing measured after the warm-up"
    for s in stats.samples:
        assert s["delivered"] <= s["flow"] * (1 + 1e-9) + 1e-9, s
        assert s["flow"] <= s["bound"] * (1 + 1e-9), s
    bound = healing_bound(sim)
    long_gaps = [g for g, spare in stats.gaps if spare and g > bound]
    assert not long_gaps, f"layers unserved past the healing bound of {bound:.0f} s: {long_gaps}"
    assert stats.completed > 0


def test_the_simulator_imports_no_torch():
    code = ("import sys; import bench.swarm_sim.run; "  # python -c: the working directory is on the path
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_every_policy_meets_the_same_world():
    """Peers (who, with what, where, from when to when) and requests draw from their own seeded
    streams: what a policy decides changes neither, so policies compare on one world."""
    def world(policy: str) -> tuple:
        sim = Sim(model=MODELS["llama-70b"], policy=make(policy), peers=60, hours=0.25, seed=3, load=0.3)
        sim.run()
        peers = sorted((p.id, p.gpu.name, p.city.name, p.joined, p.leaves_at) for p in sim.swarm.peers.values())
        return peers, sim.stats.joins, sim.stats.leaves, sim.traffic.requests_rng.random()

    assert world("shardnet") == world("least-served") == world("water-filling")
