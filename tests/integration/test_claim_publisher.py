"""A compute peer's claim publisher between real nodes: news (a new version) goes out on the gossip
topic of the layer range holding its first layer and to the DHT, what is not news changes only
the claim a direct request gets, a news reaches the DHT at most NEWS_PUT_GAP_S after the last put,
a refresh puts the same version back in the DHT, expiring later,
and the claim is provided under that range, again hourly (docs/protocols.md, "Claim dissemination"); a view
leaves a crowded range's topic for a while and follows it again after."""

import time
from contextlib import asynccontextmanager

import trio
from libp2p.peer.id import ID

from shardnet.errors import ShardnetError
from shardnet.inference.claims import claim_record_name, fetch_claims, find_claims, range_provider_name
from shardnet.inference.claims_view import ClaimsView
from shardnet.inference.probes import Probes
from shardnet.inference.server import claim_publisher
from shardnet.inference.server.claim_publisher import ClaimPublisher
from shardnet.protocols import block_claim as bc
from shardnet.testing import factories
from shardnet.transport import identity, open_node

MODEL = "ab" * 32
LAYERS = 8  # two layer ranges: 0:4 and 4:8


@asynccontextmanager
async def publisher_and_listener_nodes(loopback_config):
    """A bootstrap and two nodes, ``peer`` (whose claims go out) and ``listener``, connected."""
    async with open_node(loopback_config()) as boot, \
            open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])])) as peer, \
            open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])])) as listener:
        await peer.wait_bootstrapped()
        await listener.wait_bootstrapped()
        await listener.connect(f"{peer.listen_addrs[0]}/p2p/{peer.peer_id}")
        yield peer, listener


async def test_news_is_gossiped_with_a_new_version_and_the_rest_is_not(loopback_config, monkeypatch):
    monkeypatch.setattr(claim_publisher, "NEWS_PUT_GAP_S", 15.0)
    async with publisher_and_listener_nodes(loopback_config) as (peer, listener):
        state = {"start": 0, "end": 4, "load": 0.30}

        def claim_fn(expires: float) -> bc.Claim:
            return factories.claim(model=MODEL, peer=str(peer.peer_id), addrs=("/ip4/127.0.0.1/tcp/1",),
                                   kv_tokens=1000, tput=10.0, expires=expires, **state)

        heard: list[bc.Claim] = []
        topics: list[str] = []
        # the listener follows both ranges: the claim of 0:4 comes on the first, that of 4:8 on the other
        async with listener.pubsub.subscribe(bc.range_topic(MODEL, 0)) as sub0, \
                listener.pubsub.subscribe(bc.range_topic(MODEL, 1)) as sub1, trio.open_nursery() as nursery:
            async def listen(sub) -> None:
                async for msg in sub:
                    heard.append(bc.decode(msg.data))
                    topics.append(msg.topic)

            nursery.start_soon(listen, sub0)
            nursery.start_soon(listen, sub1)
            await trio.sleep(1.5)  # the listener's subscriptions reach the peer, a heartbeat passes
            publisher = ClaimPublisher(peer, claim_fn, num_layers=LAYERS, ttl=600.0)
            await nursery.start(publisher.run)
            with trio.fail_after(10):
                while not heard:
                    await trio.sleep(0.05)
            first = heard[0]
            assert first.seq > 0 and publisher.counts == {"news": 1, "refresh": 0}
            assert topics == [bc.range_topic(MODEL, 0)] and publisher.provided == {0}

            state["load"] = 0.33  # the same eighth of the KV budget: not news
            publisher.refresh()
            await trio.sleep(1.0)
            assert len(heard) == 1 and publisher.counts["news"] == 1
            direct = await fetch_claims(listener, str(peer.peer_id), timeout=5)
            assert [(c.seq, c.load) for c in direct] == [(first.seq, 0.33)]  # fresh, same version

            state.update(start=4, end=8)  # news: another span
            publisher.refresh()
            with trio.fail_after(10):
                while len(heard) < 2:
                    await trio.sleep(0.05)
            assert heard[1].seq > first.seq and (heard[1].start, heard[1].end) == (4, 8)
            assert topics == [bc.range_topic(MODEL, 0), bc.range_topic(MODEL, 1)]
            assert publisher.counts == {"news": 2, "refresh": 0}
            assert publisher.provided == {0, 1}  # the new range's key too (the old one stays until the hourly refresh)
            # the DHT record: the first version until NEWS_PUT_GAP_S has passed since it was put
            assert bc.decode(await listener.dht.get(peer.peer_id, claim_record_name(MODEL))).seq == first.seq
            for i in (0, 1):  # (provided after the gossip)
                with trio.fail_after(10):
                    while not await listener.dht.find_providers(range_provider_name(MODEL, i)):
                        await trio.sleep(0.1)
                assert [p.peer_id for p in await listener.dht.find_providers(range_provider_name(MODEL, i))] \
                    == [peer.peer_id]
            with trio.fail_after(30):
                while (stored := bc.decode(await listener.dht.get(peer.peer_id, claim_record_name(MODEL)))).seq \
                        != heard[1].seq:
                    await trio.sleep(0.2)

            # a refresh when a third of the TTL has passed: the same version, a later expiry, DHT only
            publisher.ttl = 3.0
            publisher.refresh()  # (to wait on the new TTL)
            with trio.fail_after(10):
                while publisher.counts["refresh"] < 1:
                    await trio.sleep(0.05)
            refreshed = bc.decode(await listener.dht.get(peer.peer_id, claim_record_name(MODEL)))
            assert refreshed.seq == heard[1].seq and refreshed.expires > stored.expires - 597
            assert len(heard) == 2 and publisher.provided == {0, 1}  # provider records: hourly
            publisher.provide_refresh_s = 0.0  # their hour has passed: the current range's key only
            publisher.refresh()
            with trio.fail_after(10):
                while publisher.provided != {1}:
                    await trio.sleep(0.05)
            answered: set[str] = set()  # (the peers that answered themselves, not from the DHT)
            found = await find_claims(listener, MODEL, num_layers=LAYERS, timeout=10, answered=answered)
            assert [c.seq for c in found] == [heard[1].seq] and found[0].expires > time.time()
            assert answered == {str(peer.peer_id)}
            nursery.cancel_scope.cancel()


async def test_a_view_leaves_a_crowded_range_for_a_while_then_follows_it_again(loopback_config):
    async with publisher_and_listener_nodes(loopback_config) as (peer, listener):
        view = ClaimsView.of(listener, MODEL, Probes(listener), num_layers=LAYERS)
        view.crowded_news, view.crowded_window_s, view.crowded_pause_s = 3, 60.0, 8.0
        view.follow([0, 1])
        view.start()
        await trio.sleep(1.5)  # the subscriptions reach the peer, a heartbeat passes
        keys = [identity.generate() for _ in range(3)]  # three publishers' claims, gossiped by peer
        seq = 0

        async def news(key, start: int = 0) -> str:
            nonlocal seq
            seq += 1
            who = str(ID.from_pubkey(key.public_key))
            claim = factories.claim(model=MODEL, peer=who, addrs=("/ip4/127.0.0.1/tcp/1",), seq=seq,
                                    start=start, end=start + 4, kv_tokens=1000, tput=10.0, expires=time.time() + 600)
            await peer.pubsub.publish(bc.range_topic(MODEL, start // 4), bc.encode(key, claim))
            return who

        for _ in range(3):  # one peer's burst of news: not crowded
            await news(keys[0])
            await trio.sleep(0.3)
        await trio.sleep(1.0)
        assert view.from_gossip == 3 and not view.paused
        for key in keys[1:]:  # news from three different peers within the window: crowded
            await news(key)
            await trio.sleep(0.3)
        with trio.fail_after(5):
            while 0 not in view.paused:
                await trio.sleep(0.05)
        assert view.following == {0, 1} and 1 not in view.paused
        heard = view.from_gossip
        first = await news(keys[0])  # not heard while the view is away
        await trio.sleep(1.0)
        assert view.from_gossip == heard and view.get(first).seq == 3  # what it heard before stays
        with trio.fail_after(15):  # back after the pause
            while 0 in view.paused:
                await trio.sleep(0.05)
        await trio.sleep(1.5)
        await news(keys[0])
        with trio.fail_after(5):
            while view.get(first).seq != seq:
                await trio.sleep(0.05)


async def test_a_failed_provide_or_put_is_retried_at_the_next_look_not_an_hour_later(loopback_config, monkeypatch):
    monkeypatch.setattr(claim_publisher, "NEWS_PUT_GAP_S", 1.0)
    async with open_node(loopback_config()) as boot, \
            open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])])) as peer:
        await peer.wait_bootstrapped()
        real_provide, real_put, failed = peer.dht.provide, peer.dht.put, []

        async def provide_once_failing(name):
            if name not in failed:
                failed.append(name)
                raise ShardnetError("no peer took it")
            return await real_provide(name)

        async def put_once_failing(name, value):
            if name not in failed:
                failed.append(name)
                raise ShardnetError("no peer took it")
            return await real_put(name, value)

        peer.dht.provide, peer.dht.put = provide_once_failing, put_once_failing
        publisher = ClaimPublisher(peer, lambda expires: factories.claim(
            model=MODEL, peer=str(peer.peer_id), addrs=("/ip4/127.0.0.1/tcp/1",), start=0, end=4, expires=expires),
            num_layers=LAYERS, ttl=600.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(publisher.run)  # its first put and provide fail
            assert failed == [claim_record_name(MODEL), range_provider_name(MODEL, 0)]
            assert publisher.provided == set()
            # both again once NEWS_PUT_GAP_S has passed (the refresh would be 200 s away, the
            # provider records' an hour)
            with trio.fail_after(10):
                while publisher.provided != {0} \
                        or await peer.dht.get(peer.peer_id, claim_record_name(MODEL)) is None:
                    await trio.sleep(0.2)
            assert publisher.counts == {"news": 1, "refresh": 0}
            nursery.cancel_scope.cancel()


async def test_a_news_gossiped_before_any_follower_was_known_is_gossiped_again_once_one_is(loopback_config):
    """A peer just started gossips its first claim before its connections have told it who
    follows the topic: that reached nobody, and a gateway learned of the restarted peer only from
    a lookup (the replica chaos test failed on it). The same version goes out again once a
    follower is known, and only then."""
    async with publisher_and_listener_nodes(loopback_config) as (peer, listener):
        def claim_fn(expires: float) -> bc.Claim:
            return factories.claim(model=MODEL, peer=str(peer.peer_id), addrs=("/ip4/127.0.0.1/tcp/1",),
                                   kv_tokens=1000, tput=10.0, expires=expires, start=0, end=4)

        async with trio.open_nursery() as nursery:
            publisher = ClaimPublisher(peer, claim_fn, num_layers=LAYERS, ttl=600.0)
            await nursery.start(publisher.run)  # nobody follows range 0 yet
            assert publisher.counts["news"] == 1 and list(publisher._unheard) == [0]
            # past gossipsub's own second chance (the message is offered to new followers for
            # gossip_window = 3 heartbeats of 1 s), as when a busy peer hears of them late
            await trio.sleep(5.0)
            async with listener.pubsub.subscribe(bc.range_topic(MODEL, 0)) as sub:
                with trio.fail_after(10):
                    claim = bc.decode((await sub.__anext__()).data)
                assert claim.seq == publisher.published.seq and publisher.counts["news"] == 1
                assert not publisher._unheard  # (heard now: watched no more)
            nursery.cancel_scope.cancel()
