"""The swarm simulation (bench/swarm_sim) publishes claims by the claim publisher's rules and
counts what they cost: news on gossip and in the DHT, refreshes in the DHT only (provider
records hourly), lookups as a
find_providers walk per layer range and a direct request per provider; a news reaches only the
views subscribed to the topic of its claim's layer range (``block_claim.neighbourhood`` of their
span; gateways follow every range); a run reports its messages per peer per second by kind; constants
mirrored from modules that need torch stay equal to them."""

import random
import re

import pytest

from bench.swarm_sim import wire
from bench.swarm_sim.events import EventLoop
from bench.swarm_sim.models import MODELS
from bench.swarm_sim.policies import Shardnet, make
from bench.swarm_sim.run import KINDS, summarize, traffic_line
from bench.swarm_sim.sim import Sim
from bench.swarm_sim.stats import Stats
from bench.swarm_sim.swarm import DHT_K, GOSSIP_D, REPUBLISH_S, Swarm
from shardnet.inference.claims import CLAIM_TTL, LOOKUP_PROVIDERS_PER_RANGE
from shardnet.inference.server.claim_publisher import NEWS_PUT_GAP_S, PROVIDE_REFRESH_S
from shardnet.protocols import block_claim as bc


def test_constants_mirrored_from_torch_modules_stay_equal():
    pytest.importorskip("torch")
    from bench.swarm_sim import swarm
    from shardnet.inference.server import compute_peer, scheduler

    assert swarm.UPKEEP_LOOKUP_S == compute_peer.UPKEEP_LOOKUP_S
    assert swarm.UPKEEP_PINGS == compute_peer.UPKEEP_PINGS
    assert swarm.SUCCESSOR_RTT_MAX_AGE_S == compute_peer.SUCCESSOR_RTT_MAX_AGE_S
    assert swarm.BATCH_TOKENS == scheduler.DEFAULT_MAX_TOKENS
    assert REPUBLISH_S == CLAIM_TTL / 3


def a_swarm(peers: int = 0, span=lambda i: (0, 1)) -> tuple[Swarm, Stats]:
    stats = Stats()
    swarm = Swarm(model=MODELS["llama-70b"], policy=make("shardnet"), target_peers=10, clock=EventLoop(3600.0),
                  stats=stats, world_rng=random.Random(1), rng=random.Random(2), warmup_s=0.0)
    for i in range(peers):
        a_peer(swarm, span(i))
    return swarm, stats


def a_peer(swarm: Swarm, span: tuple[int, int], *, listening: bool = False):
    """A peer serving ``span`` that has published its claim; ``listening``: its claims view is
    subscribed to its neighbourhood's topics."""
    p = swarm.new_peer(swarm.now)
    swarm.peers[p.id] = p
    p.target = p.span = span
    if listening:
        p.view_started = True
        swarm.subscribe(p)
    swarm.look(p)
    return p


def test_only_news_is_gossiped_and_a_refresh_is_a_dht_put_providing_hourly():
    swarm, stats = a_swarm()
    a_peer(swarm, (0, 4), listening=True)  # hears the news of range 0
    stats.msgs.clear()
    stats.publications.clear()
    stats.news_why.clear()
    p = a_peer(swarm, (0, 4))
    assert stats.publications == {"news": 1} and stats.news_why == {"first claim": 1}
    assert swarm.claims[p.id].seq == 1 and stats.msgs["gossip"] == GOSSIP_D  # one topic, one listener
    gossip, dht = stats.msgs["gossip"], stats.msgs["dht"]

    swarm.clock.now = 60.0
    p.kv_used = p.kv_bytes // 100  # load 1 %: in the same eighth, free KV tokens within a quarter
    swarm.look(p)  # nothing is news and no refresh is due: nothing goes out
    assert stats.msgs["gossip"] == gossip and stats.msgs["dht"] == dht and stats.publications["news"] == 1

    swarm.clock.now = REPUBLISH_S
    swarm.look(p)  # a refresh: the same version, in the DHT only, a put (its provider record is younger than an hour)
    walk = swarm.walk_rpcs()
    assert stats.publications["refresh"] == 1 and stats.msgs["gossip"] == gossip
    assert stats.msgs["dht"] == dht + walk + DHT_K
    assert swarm.claims[p.id].seq == 1
    dht = stats.msgs["dht"]

    swarm.clock.now = REPUBLISH_S + 30
    p.kv_used = p.kv_bytes // 2  # the load moves four eighths: news, a new version, on gossip and in the DHT
    swarm.look(p)
    assert stats.news_why["load"] == 1 and swarm.claims[p.id].seq == 2 and stats.msgs["gossip"] > gossip
    assert bc.news(swarm.claims[p.id], swarm.claim_of(p)) is None
    assert stats.msgs["dht"] == dht + walk + DHT_K
    dht, gossip = stats.msgs["dht"], stats.msgs["gossip"]

    swarm.clock.now = REPUBLISH_S + 40
    p.kv_used = p.kv_bytes  # news again, 10 s after the last put: on gossip now, in the DHT 30 s after that put
    swarm.look(p)
    assert swarm.claims[p.id].seq == 3 and stats.msgs["gossip"] > gossip and stats.msgs["dht"] == dht
    swarm.clock.run_until(REPUBLISH_S + 30 + NEWS_PUT_GAP_S)
    assert stats.msgs["dht"] == dht + walk + DHT_K and stats.publications == {"news": 3, "refresh": 1}
    dht = stats.msgs["dht"]

    swarm.clock.now = PROVIDE_REFRESH_S
    swarm.look(p)  # a refresh an hour after it provided: a put and a provide
    assert stats.msgs["dht"] == dht + 2 * (walk + DHT_K)


def test_a_lookup_is_a_walk_per_range_and_a_direct_request_per_provider():
    swarm, stats = a_swarm(80)  # all 80 on layer 0: providers of range 0 only
    stats.msgs.clear()
    stats.bytes.clear()
    swarm.count_lookup()
    assert stats.msgs["direct"] == LOOKUP_PROVIDERS_PER_RANGE  # a sample of range 0's 80 providers
    assert stats.msgs["dht"] == len(swarm.ranges) * swarm.walk_rpcs()  # a walk per range, empty or not
    assert stats.bytes["direct"] >= LOOKUP_PROVIDERS_PER_RANGE * wire.direct_request(500)

    swarm, stats = a_swarm(80, span=lambda i: (i, i + 1))  # 5 providers in each of the 16 ranges
    stats.msgs.clear()
    swarm.count_lookup()
    assert stats.msgs["direct"] == 80  # every provider, each asked once


def test_a_claims_size_is_measured_with_the_real_encoder():
    sizes = [wire.claim_bytes("public", n, False) for n in (0, 1, bc.MAX_RTTS)]
    assert 300 < sizes[0] < sizes[1] < sizes[2] <= bc.MAX_CLAIM_BYTES
    assert wire.claim_bytes("private", 0, True) > wire.claim_bytes("private", 0, False)


def a_listening_peer(swarm: Swarm, span: tuple[int, int]):
    """A compute peer serving ``span``, its claims view subscribed, its claim published."""
    p = swarm.new_peer(swarm.now)
    swarm.peers[p.id] = p
    p.target = p.span = span
    p.view_started = True
    swarm.subscribe(p)
    swarm.look(p)
    return p


def test_a_news_reaches_only_the_views_whose_neighbourhood_holds_one_of_its_ranges():
    swarm, stats = a_swarm()  # llama-70b: 80 layers, 16 ranges of 5
    first = a_listening_peer(swarm, (0, 5))  # published on range 0; follows ranges 0 and 1
    assert sorted(first.subs) == bc.neighbourhood(0, 5, 80) == [0, 1]
    assert stats.msgs["gossip"] == 0  # nobody else listens

    far = a_listening_peer(swarm, (60, 65))  # range 12 (follows 12 and 13): nobody else follows it
    assert stats.msgs["gossip"] == 0
    assert not swarm.heard(first, far.id) and not swarm.heard(far, first.id)
    assert far.id not in {c.peer for c in swarm.view_claims(first)[0]}

    near = a_listening_peer(swarm, (5, 10))  # range 1 (follows 1 and 2); first follows 1
    assert stats.msgs["gossip"] == GOSSIP_D * 1  # to first, on range 1's topic
    assert swarm.heard(first, near.id) and not swarm.heard(far, near.id)

    stats.msgs.clear()
    swarm.clock.now = 30.0
    first.target = (60, 70)  # first loads layers 60:70: its news goes on ranges 0 and 12
    swarm.look(first)
    assert swarm.claim_ranges(swarm.claims[first.id]) == [0, 12]
    # far follows range 12; nobody else follows range 0 (near follows 1 and 2)
    assert stats.msgs["gossip"] == GOSSIP_D * 1
    assert swarm.heard(far, first.id) and not swarm.heard(near, first.id)
    assert swarm.visible(first.id, {})  # gateways follow every range: news fills their views

    stats.msgs.clear()
    swarm.gateway_followers = 3  # (the traffic sets it: its gateways)
    swarm.clock.now = 60.0
    far.target = (0, 5)  # news on ranges 12 and 0: 3 gateways on each, and first on one of them
    swarm.look(far)
    assert swarm.claim_ranges(swarm.claims[far.id]) == [0, 12]
    assert stats.msgs["gossip"] == GOSSIP_D * (3 * 2 + 1)


def test_a_topic_joined_later_hears_only_the_news_that_follows():
    swarm, _ = a_swarm()
    speaker = a_listening_peer(swarm, (0, 5))
    swarm.clock.now = 10.0
    late = a_listening_peer(swarm, (5, 10))
    assert not swarm.heard(late, speaker.id)  # its news went out before late subscribed
    swarm.look_up_into(late.looked_up)  # a lookup finds it
    assert speaker.id in {c.peer for c in swarm.view_claims(late)[0]}


def test_a_run_reports_messages_per_peer_per_second_by_kind():
    sim = Sim(model=MODELS["llama-70b"], policy=make("shardnet"), peers=12, hours=0.1, seed=2, warmup_s=60.0)
    summary = summarize(sim, sim.run(), 0.0)
    line = traffic_line(summary)
    for kind in KINDS:
        assert re.search(rf"\b{kind} \d+\.\d \(\d+\.\d KB\)", line), line
    assert all(summary["msgs"].get(kind, 0) > 0 for kind in ("gossip", "dht", "direct")), summary["msgs"]
    assert "claims in a compute peer's view at upkeep" in line


def test_a_large_view_is_planned_over_samples_that_stand_for_the_rest():
    swarm, _ = a_swarm()
    me = a_listening_peer(swarm, (0, 5))
    others = [a_listening_peer(swarm, (0, 5)) for _ in range(20)]
    whole, held = swarm.view_claims(me, None)
    assert held == len(whole) == 20 and {c.peer for c in whole} == {q.id for q in others}
    sample, estimate = swarm.view_claims(me, 8)  # at most 4 of the news heard (21 candidates, me too)
    assert 0 < len(sample) <= 4 and estimate == round(len(sample) * 21 / 4)
    for c in sample:  # each stands for 21 / 4 claims of the view
        assert c.tput == swarm.claims[c.peer].tput * 21 / 4


def test_a_view_of_many_providers_is_drawn_by_slot_each_claim_standing_for_its_share():
    swarm, _ = a_swarm()
    me = a_listening_peer(swarm, (0, 5))
    for _ in range(40):
        a_listening_peer(swarm, (0, 5))
    sample, estimate = swarm.view_claims(me, 8)  # 41 slots (range 0's providers) > 8 x 4: 4 drawn
    assert 0 < len(sample) <= 4 and abs(estimate - len(sample) * 41 / 4) <= 0.5
    for c in sample:
        assert c.tput == swarm.claims[c.peer].tput * 41 / 4


def test_the_edge_follow_what_if_follows_the_first_layers_and_the_layer_after_the_span():
    swarm, _ = a_swarm()  # llama-70b: 80 layers, 16 ranges of 5
    assert swarm.followed_ranges((5, 40)) == set(bc.neighbourhood(5, 40, 80)) == set(range(1, 9))
    swarm.policy = Shardnet(follow_edges=True)
    assert swarm.followed_ranges((5, 40)) == {1, 8}
    assert swarm.followed_ranges((40, 80)) == {8}  # nothing after the last layer


def test_a_view_leaves_a_range_crowded_with_news_of_many_peers_and_follows_it_again_after_a_pause():
    from bench.swarm_sim.swarm import CROWDED_NEWS, CROWDED_PAUSE_S, CROWDED_WINDOW_S

    swarm, stats = a_swarm()  # llama-70b: 80 layers, 16 ranges of 5
    me = a_listening_peer(swarm, (0, 5))  # follows ranges 0 and 1
    swarm.clock.now = 1.0
    first = a_listening_peer(swarm, (5, 10))  # a news on range 1
    for i in range(CROWDED_NEWS - 2):  # more news on range 1 within the window: not yet crowded
        swarm.clock.now = 2.0 + i * CROWDED_WINDOW_S / (2 * CROWDED_NEWS)
        a_peer(swarm, (5, 10))
    assert set(me.subs) == {0, 1} and not me.paused
    stats.msgs.clear()
    a_peer(swarm, (5, 10))  # the CROWDED_NEWS-th: heard, then me and first leave range 1
    assert stats.msgs["gossip"] == GOSSIP_D * 2
    assert set(me.subs) == {0} and set(me.paused) == {1} and 1 not in first.subs
    assert swarm.heard(me, first.id)  # what it heard stays in its view
    stats.msgs.clear()
    swarm.clock.now += 1.0
    later = a_peer(swarm, (5, 10))
    assert stats.msgs["gossip"] == 0 and not swarm.heard(me, later.id)
    swarm.clock.run_until(swarm.now + CROWDED_PAUSE_S + 1)  # the pause ends: it follows range 1 again
    assert set(me.subs) == {0, 1} and not me.paused


def test_the_follow_crowded_what_if_never_leaves_a_topic():
    swarm, _ = a_swarm()
    swarm.policy = Shardnet(follow_crowded=True)
    me = a_listening_peer(swarm, (0, 5))
    for _ in range(3 * 16):
        a_peer(swarm, (5, 10))
    assert set(me.subs) == {0, 1} and not me.paused


def test_one_peers_burst_of_news_crowds_no_topic():
    swarm, _ = a_swarm()
    me = a_listening_peer(swarm, (0, 5))
    busy = a_peer(swarm, (5, 10))
    for i in range(3 * 16):  # news after news from one peer (its load moving), within the window
        swarm.clock.now = 1.0 + i
        busy.kv_used = busy.kv_bytes * (i % 2)
        swarm.look(busy)
    assert swarm.claims[busy.id].seq > 16 and set(me.subs) == {0, 1} and not me.paused
