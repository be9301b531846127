"""A compute peer's claim publisher between real nodes: news (a new version) goes out on the gossip
topic of the layer range holding its first layer and to the DHT, what is not news changes only
the claim a direct request gets, a refresh puts the same version back in the DHT, expiring later,
and the claim is provided under that range (docs/protocols.md, "Claim dissemination")."""

import time

import trio

from shardnet.inference.claims import claim_record_name, fetch_claims, find_claims, range_provider_name
from shardnet.inference.server.claim_publisher import ClaimPublisher
from shardnet.protocols import block_claim as bc
from shardnet.testing import factories
from shardnet.transport import open_node

MODEL = "ab" * 32
LAYERS = 8  # two layer ranges: 0:4 and 4:8


async def test_news_is_gossiped_with_a_new_version_and_the_rest_is_not(loopback_config):
    async with open_node(loopback_config()) as boot, \
            open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])])) as peer, \
            open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])])) as listener:
        await peer.wait_bootstrapped()
        await listener.wait_bootstrapped()
        await listener.connect(f"{peer.listen_addrs[0]}/p2p/{peer.peer_id}")
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
            assert publisher.provided == {0, 1}  # the new range's key too (the old one stays until a refresh)
            for i in (0, 1):  # (provided after the gossip and the DHT record)
                with trio.fail_after(10):
                    while not await listener.dht.find_providers(range_provider_name(MODEL, i)):
                        await trio.sleep(0.1)
                assert [p.peer_id for p in await listener.dht.find_providers(range_provider_name(MODEL, i))] \
                    == [peer.peer_id]
            stored = bc.decode(await listener.dht.get(peer.peer_id, claim_record_name(MODEL)))
            assert stored.seq == heard[1].seq

            # a refresh when a third of the TTL has passed: the same version, a later expiry, DHT only
            publisher.ttl = 3.0
            publisher.refresh()  # (to wait on the new TTL)
            with trio.fail_after(10):
                while publisher.counts["refresh"] < 1:
                    await trio.sleep(0.05)
            refreshed = bc.decode(await listener.dht.get(peer.peer_id, claim_record_name(MODEL)))
            assert refreshed.seq == heard[1].seq and refreshed.expires > stored.expires - 597
            assert len(heard) == 2 and publisher.provided == {1}
            found = await find_claims(listener, MODEL, num_layers=LAYERS, timeout=10)
            assert [c.seq for c in found] == [heard[1].seq] and found[0].expires > time.time()
            nursery.cancel_scope.cancel()
