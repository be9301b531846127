"""The swarm simulation (bench/swarm_sim) follows claim dissemination 2: a news reaches only the
views subscribed to the topics of its claim's layer ranges (``block_claim.neighbourhood`` of
their span), gateways hear none, and a run reports its control messages per peer per second by
kind."""

import random
import re

from bench.swarm_sim.events import EventLoop
from bench.swarm_sim.models import MODELS
from bench.swarm_sim.policies import make
from bench.swarm_sim.run import KINDS, summarize, traffic_line
from bench.swarm_sim.sim import Sim
from bench.swarm_sim.stats import Stats
from bench.swarm_sim.swarm import GOSSIP_D, Swarm
from shardnet.protocols.block_claim import neighbourhood, ranges_of


def a_swarm() -> tuple[Swarm, Stats]:
    stats = Stats()
    swarm = Swarm(model=MODELS["llama-70b"], policy=make("shardnet"), target_peers=10, clock=EventLoop(3600.0),
                  stats=stats, world_rng=random.Random(1), rng=random.Random(2), warmup_s=0.0)
    return swarm, stats


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
    first = a_listening_peer(swarm, (0, 5))  # range 0; follows ranges 0 and 1
    assert sorted(first.subs) == neighbourhood(0, 5, 80) == [0, 1]
    assert stats.msgs["gossip"] == 0  # nobody else listens

    far = a_listening_peer(swarm, (60, 65))  # range 12: nobody else follows it
    assert stats.msgs["gossip"] == 0
    assert not swarm.heard(first, far.id) and not swarm.heard(far, first.id)
    assert far.id not in {c.peer for c in swarm.view_claims(first)[0]}

    near = a_listening_peer(swarm, (5, 10))  # range 1: ranges 0, 1 and 2 followed; first follows 1
    assert stats.msgs["gossip"] == GOSSIP_D * 1  # to first, on range 1's topic
    assert swarm.heard(first, near.id) and not swarm.heard(far, near.id)

    stats.msgs.clear()
    swarm.clock.now = 30.0
    first.target = (60, 70)  # first loads layers 60:70: its news goes on ranges 0, 12 and 13
    swarm.look(first)
    assert swarm.claim_ranges(swarm.claims[first.id]) == (0, 12, 13)
    assert [0, 12, 13] == ranges_of(0, 5, 80) + ranges_of(60, 70, 80)
    # near on range 0's topic; far, following ranges 11 to 13, on 12's and 13's: once per topic
    assert stats.msgs["gossip"] == GOSSIP_D * 3
    assert swarm.heard(far, first.id) and swarm.heard(near, first.id)
    assert not swarm.visible(first.id, {})  # a gateway hears no news: only its lookups fill its view


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
