"""Claim dissemination 2 between real compute peers in this process (the shipped model: 8 layers,
two layer ranges, 0:4 and 4:8): a peer's claims view hears on gossip the news of the peers serving
layers next to its own and not of those far from it, follows its new neighbourhood after it
moves, and a lookup over every range finds every peer, whether it asks every DHT server (fewer
than k of them, as here) or the ranges' provider records (docs/protocols.md, "Claim
dissemination")."""

import time
from contextlib import AsyncExitStack

import trio

from shardnet.inference.claims import find_claims
from shardnet.inference.server.claim_publisher import ClaimPublisher
from shardnet.inference.server.compute_peer import join_swarm
from shardnet.models import default_model_path
from shardnet.protocols import block_claim as bc
from shardnet.transport import open_node

PATH = default_model_path()
LAYERS = 8


async def news(peer) -> int:
    """The peer's throughput doubles (news): its new version, once published."""
    publisher = peer.node.behaviour(ClaimPublisher)
    seq = publisher.published.seq
    peer.tput *= 2
    publisher.refresh()
    with trio.fail_after(10):
        while publisher.published.seq == seq:
            await trio.sleep(0.05)
    return publisher.published.seq


async def heard(view, peer, seq: int) -> None:
    """Until ``view`` holds ``peer``'s claim of version ``seq``."""
    with trio.fail_after(15):
        while (c := view.get(str(peer.node.peer_id))) is None or c.seq < seq:
            await trio.sleep(0.05)


async def test_news_reaches_neighbours_only_and_a_lookup_finds_every_peer(loopback_config):
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config()))
        cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
        peers = {}
        for name, span in {"a": (0, 2), "b": (2, 4), "d": (5, 6), "c": (6, 8)}.items():
            node = await stack.enter_async_context(open_node(cfg))
            await node.wait_bootstrapped()
            peers[name] = await stack.enter_async_context(
                join_swarm(node, str(PATH), layers=span, rebalance_interval=0, throughput=100.0))
        a, b, c, d = (peers[n] for n in "abcd")
        # a claim goes on the range of its first layer; a peer follows its span's ranges and its
        # successors' first layer's
        assert a.view.following == {0} and b.view.following == {0, 1}
        assert c.view.following == {1} and d.view.following == {1}
        for x in peers.values():  # gossip goes to connected subscribers: connect them all
            x.view.start()
            for y in peers.values():
                if x is not y:
                    await x.node.connect(f"{y.node.listen_addrs[0]}/p2p/{y.node.peer_id}")
        for x in peers.values():
            with trio.fail_after(15):
                await x.view.first_lookup.wait()
        await trio.sleep(2.5)  # subscriptions known, meshes grafted (heartbeats of 1 s)

        # b (range 0) is a's neighbour; c (range 1) is d's, far from a (it follows range 0)
        b_seq, c_seq = await news(b), await news(c)
        await heard(a.view, b, b_seq)
        await heard(d.view, c, c_seq)
        await trio.sleep(1.0)
        old = a.view.get(str(c.node.peer_id))  # (c's claim as a's lookup found it, if it did)
        assert old is None or old.seq < c_seq
        assert a.view.from_gossip >= 1 and a.view.lookups == 1  # b's news came by gossip

        # a moves next to c: its view follows the ranges there instead, and hears c's news
        await a.load(4, 5)
        assert a.view.following == set(bc.neighbourhood(4, 5, LAYERS)) == {1}
        await a.load(6, 8)
        a.node.behaviour(ClaimPublisher).refresh()  # (as upkeep does after a move)
        assert a.view.following == {1}
        await trio.sleep(2.5)  # the new subscriptions known, meshes grafted
        c_seq = await news(c)
        await heard(a.view, c, c_seq)
        assert a.view.lookups == 1

        # a lookup over every range, from a client node, finds every peer; over some, those there
        client = await stack.enter_async_context(open_node(cfg))
        await client.wait_bootstrapped()
        ids = {n: str(p.node.peer_id) for n, p in peers.items()}
        with trio.fail_after(30):
            while {x.peer for x in await find_claims(client, a.model_id, num_layers=LAYERS)} != set(ids.values()):
                await trio.sleep(0.5)
        found = await find_claims(client, a.model_id, num_layers=LAYERS, ranges=[1])
        names = {n for n, i in ids.items() if i in {x.peer for x in found}}
        assert names == {"a", "c", "d"}, names  # a moved to 6:8: range 1 now
        # a view's lookup takes a sample of each range's providers (status takes them all)
        one = await find_claims(client, a.model_id, num_layers=LAYERS, ranges=[1], per_range=1)
        assert len(one) == 1 and one[0].peer in {ids["a"], ids["c"], ids["d"]}

        # the same through the ranges' provider records (what a network of k DHT servers or
        # more takes; this one has fewer, so its lookups asked every server directly)
        async def many_servers():
            return None

        client.dht.servers_if_few = many_servers
        assert {x.peer for x in await find_claims(client, a.model_id, num_layers=LAYERS)} == set(ids.values())
        found = await find_claims(client, a.model_id, num_layers=LAYERS, ranges=[1])
        assert {x.peer for x in found} == {ids["a"], ids["c"], ids["d"]}
        one = await find_claims(client, a.model_id, num_layers=LAYERS, ranges=[1], per_range=1)
        assert len(one) == 1


async def test_a_successors_round_trip_is_measured_once_then_again_when_it_is_old(loopback_config, monkeypatch):
    """Upkeep runs every 2 s while a peer settles: a known successor is pinged again only once its
    round trip is SUCCESSOR_RTT_MAX_AGE_S old; a new successor at once."""
    from shardnet.inference.server import compute_peer

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config()))
        cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
        peers = []
        for span in ((0, 4), (4, 8), (4, 8)):
            node = await stack.enter_async_context(open_node(cfg))
            await node.wait_bootstrapped()
            peers.append(await stack.enter_async_context(
                join_swarm(node, str(PATH), layers=span, rebalance_interval=0, throughput=100.0)))
        first, second, third = peers
        pinged: list[str] = []
        ping_many = first.node.ping_many

        async def counting(ps, **kw):
            pinged.extend(ps)
            return await ping_many(ps, **kw)

        monkeypatch.setattr(first.node, "ping_many", counting)
        claims = [second.claim(time.time() + 60)]
        await first.measure_successors(claims)
        assert pinged == [claims[0].peer] and claims[0].peer in first.successor_rtts
        await first.measure_successors(claims)  # fresh: not pinged again, still reported
        assert pinged == [claims[0].peer] and claims[0].peer in first.successor_rtts
        claims.append(third.claim(time.time() + 60))  # a new successor: pinged at once, alone
        await first.measure_successors(claims)
        assert pinged == [claims[0].peer, claims[1].peer] and len(first.successor_rtts) == 2
        monkeypatch.setattr(compute_peer, "SUCCESSOR_RTT_MAX_AGE_S", 0.0)  # both old now
        await first.measure_successors(claims)
        assert sorted(pinged[2:]) == sorted(c.peer for c in claims)
        await first.measure_successors(claims[1:])  # one left: the other is no successor any more
        assert list(first.successor_rtts) == [claims[1].peer]
