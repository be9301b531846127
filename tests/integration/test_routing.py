"""Latency-aware routing on real hosts: two chains serve the model, one behind emulated WAN
delay (bench/wan_emulator.py: the slow peers announce their proxy's address); the client
measures round trips and routes through the fast chain every time, and peers publish their
measured round trips to the peers after them. And a peer announcing a fake throughput takes no
more first routes than its layers' honest peers, and none once the client saw its steps.

No absolute time is asserted: every node runs in this one process, and on a loaded machine its
event loop alone can add tens of ms to a round trip. The delay is large against that, and
round trips are compared with the delayed path's, measured in the same run."""

from contextlib import AsyncExitStack

import trio

from shardnet.inference.claims import find_claims
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.server.compute_peer import join_swarm
from shardnet.models import default_model_path
from shardnet.testing.helpers import free_port
from shardnet.transport import open_node

DELAY = 0.1  # one way, per slow peer: a round trip through its proxy takes >= 2 * DELAY


async def test_routing_picks_the_low_latency_chain(loopback_config):
    from bench.wan_emulator import Link, WanProxy

    path = default_model_path()
    async with trio.open_nursery() as nursery:  # the proxies outlive every node
        async with AsyncExitStack() as stack:
            boot = await stack.enter_async_context(open_node(loopback_config(low_watermark=0)))
            boot_addr = [str(boot.listen_addrs[0])]
            peers = {}

            async def peer(name, a, b, delay):
                kw = {}
                if delay:
                    real, pub = free_port(), free_port()
                    await nursery.start(WanProxy(("127.0.0.1", real), Link(delay=delay), port=pub).serve)
                    kw = {"listen": [f"/ip4/127.0.0.1/tcp/{real}"], "announce": [f"/ip4/127.0.0.1/tcp/{pub}"]}
                node = await stack.enter_async_context(open_node(loopback_config(
                    bootstrap=boot_addr, low_watermark=0, **kw)))
                await stack.enter_async_context(join_swarm(node, str(path), layers=(a, b), rebalance_interval=1.0))
                peers[name] = str(node.peer_id)

            for name, a, b, delay in (("a1", 0, 4, 0), ("a2", 4, 8, 0), ("b1", 0, 4, DELAY), ("b2", 4, 8, DELAY)):
                await peer(name, a, b, delay)
            # a client that nobody dials (DHT client, no auto-dialling): its connections to the
            # slow peers are its own, through their proxies
            node = await stack.enter_async_context(open_node(loopback_config(
                bootstrap=boot_addr, low_watermark=0, dht_mode="client")))
            await node.wait_bootstrapped()
            client = Client(node, LocalModel(path))
            names = {v: k for k, v in peers.items()}

            # peers report round trips to the peers serving the layers after theirs (a poll, not a
            # timing assertion: under a loaded machine the first rounds can take a while)
            claims, reported = {}, {}
            with trio.move_on_after(60):
                while True:
                    claims = {c.peer: c for c in await find_claims(node, client.model.model_id,
                                                                    num_layers=client.model.ckpt.num_layers)}
                    reported = {names[p]: t for p, t in claims[peers["a1"]].rtts} if peers["a1"] in claims else {}
                    if {"a2", "b2"} <= reported.keys() and len(claims) == 4:
                        break
                    await trio.sleep(0.5)
            assert {"a2", "b2"} <= reported.keys() and len(claims) == 4, (
                "claims seen: " + str({names.get(p, p): c.rtts for p, c in claims.items()}))
            assert not claims[peers["a2"]].rtts  # the last span has no successors

            for _ in range(5):  # a random choice would take the fast chain 1 time in 4
                route = await client.planner.find_route()
                assert [names[c.peer] for c in route] == ["a1", "a2"], (
                    [names[c.peer] for c in route], {n: client.planner.rtt(p) for n, p in peers.items()},
                    {names.get(p, p): t for p, t in client.planner._avoid.items()})
            slow = client.planner.rtt(peers["b1"])
            assert slow >= 2 * DELAY  # the emulator's floor
            # (a1's round trip to b2 is not checked: a connection b2 opened towards a1 crosses
            # a1's side, with no delay, since the emulator delays traffic on the callee's side only)
            assert client.planner.rtt(peers["a1"]) < slow and 0 < reported["a2"] < slow, (reported, slow)
            got = [t.id async for t in client.generate("def main(", max_new_tokens=4, stop_at_eos=False)]
            assert len(got) == 4 and [names[c.peer] for c in client.last_stats.chain] == ["a1", "a2"]
        nursery.cancel_scope.cancel()


OVER_ANNOUNCED = 100000.0  # tokens/s; the tiny model measures some hundreds on this machine's CPU
SESSIONS = 6


async def test_a_peer_over_announcing_its_throughput_does_not_take_most_first_routes(loopback_config):
    """Layers 0:4 on one peer, 4:8 on two honest peers (their own measured throughput) and one
    announcing ``OVER_ANNOUNCED`` (``join --throughput``), which believing claims made the first
    hop after 0:4 of every route. Never observed, it counts as its layers' typical peer (a tie);
    once a session went through it, its steps belie its claim and it is routed around."""
    path = default_model_path()
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config(low_watermark=0)))
        boot_addr = [str(boot.listen_addrs[0])]
        names = {}
        for name, a, b, tput in (("a", 0, 4, None), ("b", 4, 8, None), ("c", 4, 8, None),
                                 ("liar", 4, 8, OVER_ANNOUNCED)):
            node = await stack.enter_async_context(open_node(loopback_config(bootstrap=boot_addr, low_watermark=0)))
            await stack.enter_async_context(join_swarm(node, str(path), layers=(a, b), throughput=tput))
            names[str(node.peer_id)] = name
        node = await stack.enter_async_context(open_node(loopback_config(
            bootstrap=boot_addr, low_watermark=0, dht_mode="client")))
        await node.wait_bootstrapped()
        client = Client(node, LocalModel(path), audit_rate=0.0)
        with trio.fail_after(60):  # every claim seen before the first route
            while len(await client.planner.usable_claims()) < 4:
                await trio.sleep(0.2)
        first_routes = []
        for _ in range(SESSIONS):
            route = await client.planner.find_route()
            first_routes.append([names[c.peer] for c in route])
            got = [t.id async for t in client.generate("def main(", max_new_tokens=6, stop_at_eos=False,
                                                       route=route)]
            assert len(got) == 6
        through_liar = [i for i, r in enumerate(first_routes) if "liar" in r]
        assert len(through_liar) < SESSIONS / 2, first_routes
        if through_liar:  # seen once, marked and routed around
            assert {names[p] for p in client.reputation.overclaimers()} == {"liar"}, client.reputation.to_json()
            assert through_liar == [through_liar[0]], first_routes
        print("first routes:", first_routes)
