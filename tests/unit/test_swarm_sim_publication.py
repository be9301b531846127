"""The swarm simulation (bench/swarm_sim) publishes claims by the claim publisher's rules and
counts what they cost: news on gossip and in the DHT, refreshes in the DHT only, lookups as a
find_providers walk and direct requests; constants mirrored from modules that need torch stay
equal to them."""

import random

import pytest

from bench.swarm_sim import wire
from bench.swarm_sim.events import EventLoop
from bench.swarm_sim.models import MODELS
from bench.swarm_sim.policies import make
from bench.swarm_sim.stats import Stats
from bench.swarm_sim.swarm import LOOKUP_PROVIDERS, REPUBLISH_S, Swarm
from shardnet.inference.claims import CLAIM_TTL
from shardnet.protocols import block_claim as bc


def test_constants_mirrored_from_torch_modules_stay_equal():
    pytest.importorskip("torch")
    from bench.swarm_sim import swarm
    from shardnet.inference.server import compute_peer, scheduler

    assert swarm.UPKEEP_LOOKUP_S == compute_peer.UPKEEP_LOOKUP_S
    assert swarm.UPKEEP_PINGS == compute_peer.UPKEEP_PINGS
    assert swarm.BATCH_TOKENS == scheduler.DEFAULT_MAX_TOKENS
    assert REPUBLISH_S == CLAIM_TTL / 3


def a_swarm(peers: int = 0) -> tuple[Swarm, Stats]:
    stats = Stats()
    swarm = Swarm(model=MODELS["llama-70b"], policy=make("shardnet"), target_peers=10, clock=EventLoop(3600.0),
                  stats=stats, world_rng=random.Random(1), rng=random.Random(2), warmup_s=0.0)
    for _ in range(peers):
        p = swarm.new_peer(0.0)
        swarm.peers[p.id] = p
        p.target = p.span = (0, 1)
        swarm.look(p)
    return swarm, stats


def test_only_news_is_gossiped_and_a_refresh_is_a_dht_put_and_provide():
    swarm, stats = a_swarm()
    p = swarm.new_peer(0.0)
    swarm.peers[p.id] = p
    p.target = p.span = (0, 4)
    swarm.look(p)
    assert stats.publications == {"news": 1} and stats.news_why == {"first claim": 1}
    assert swarm.claims[p.id].seq == 1 and stats.msgs["gossip"] > 0
    gossip, dht = stats.msgs["gossip"], stats.msgs["dht"]

    swarm.clock.now = 60.0
    p.kv_used = p.kv_bytes // 100  # load 1 %: in the same eighth, free KV tokens within a quarter
    swarm.look(p)  # nothing is news and no refresh is due: nothing goes out
    assert stats.msgs["gossip"] == gossip and stats.msgs["dht"] == dht and stats.publications["news"] == 1

    swarm.clock.now = REPUBLISH_S
    swarm.look(p)  # a refresh: the same version, in the DHT only
    assert stats.publications["refresh"] == 1 and stats.msgs["gossip"] == gossip and stats.msgs["dht"] > dht
    assert swarm.claims[p.id].seq == 1

    swarm.clock.now = REPUBLISH_S + 30
    p.kv_used = p.kv_bytes // 2  # the load moves four eighths: news, a new version, on gossip
    swarm.look(p)
    assert stats.news_why["load"] == 1 and swarm.claims[p.id].seq == 2 and stats.msgs["gossip"] > gossip
    assert bc.news(swarm.claims[p.id], swarm.claim_of(p)) is None


def test_a_lookup_is_a_walk_and_a_direct_request_per_provider():
    swarm, stats = a_swarm(80)
    swarm.count_lookup()
    assert stats.msgs["direct"] == LOOKUP_PROVIDERS  # at most 64 providers asked, of 80
    assert stats.msgs["dht"] > 0 and stats.bytes["direct"] >= LOOKUP_PROVIDERS * wire.direct_request(500)


def test_a_claims_size_is_measured_with_the_real_encoder():
    sizes = [wire.claim_bytes("public", n, False) for n in (0, 1, bc.MAX_RTTS)]
    assert 300 < sizes[0] < sizes[1] < sizes[2] <= bc.MAX_CLAIM_BYTES
    assert wire.claim_bytes("private", 0, True) > wire.claim_bytes("private", 0, False)
