"""What concurrent requests of one client process share (real nodes in this process, the
shipped model): one view of the swarm's claims, one probe per peer at a time, a line for
sessions; and what a peer that failed must do to be routed through again (claim anew)."""

from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from shardnet.errors import InferenceError, NoRouteError
from shardnet.inference.client.client import Client
from shardnet.inference.model.local_model import LocalModel
from shardnet.inference.server.claim_publisher import ClaimPublisher
from shardnet.inference.server.compute_peer import serve_block
from shardnet.models import default_model_path
from shardnet.transport import open_node
from shardnet.transport.errors import ShardnetError
from shardnet.transport.limits import Limits

PATH = default_model_path()


@asynccontextmanager
async def chain(loopback_config, ranges, **client_kw):
    """A bootstrap, a compute node per range, a client node: (compute nodes, client node)."""
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config()))
        cfg = dict(bootstrap=[str(boot.listen_addrs[0])])
        peers = []
        for a, b in ranges:
            peer = await stack.enter_async_context(open_node(loopback_config(**cfg)))
            await stack.enter_async_context(serve_block(peer, str(PATH), a, b))
            peers.append(peer)
        node = await stack.enter_async_context(open_node(loopback_config(**cfg, **client_kw)))
        await node.wait_bootstrapped()
        yield peers, node


async def test_concurrent_requests_share_one_view_and_one_probe_per_peer(loopback_config):
    async with chain(loopback_config, [(0, 4), (4, 8)]) as (peers, node):
        model = LocalModel(PATH)
        client = Client(node, model)
        await client.planner.find_route()
        view, probes = client.planner.view, client.planner.probes
        assert Client(node, model).planner.view is view and Client(node, model).planner.probes is probes
        probes.results.clear()  # every peer needs probing again
        sent, lookups = probes.sent, view.lookups
        routes = []

        async def route():
            routes.append(await client.planner.find_route())

        async with trio.open_nursery() as nursery:
            for _ in range(32):
                nursery.start_soon(route)
        assert len(routes) == 32
        assert probes.sent - sent == 2  # one probe per peer, shared by the 32 requests
        assert view.lookups - lookups <= 1  # none of their own (a background refresh may fall in)

        # a lookup that finds nothing (refused, timed out) keeps what is known
        known = sorted(c.peer for c in view.current())
        await view.lookup(timeout=0.0)
        assert view.last_lookup_error and sorted(c.peer for c in view.current()) == known
        assert [c.peer for c in await client.planner.find_route(timeout=1)] == [str(p.peer_id) for p in peers]


async def test_a_failed_peer_that_claims_again_is_routed_through(loopback_config):
    async with chain(loopback_config, [(0, 4), (4, 8)]) as (peers, node):
        client = Client(node, LocalModel(PATH))
        first = str(peers[0].peer_id)
        assert (await client.planner.find_route())[0].peer == first
        client.planner.forget_peer(first)  # as healing does when it failed during a request
        with pytest.raises(NoRouteError, match="layers 0-3"):
            await client.planner.find_route(timeout=1)
        # it claims anew (a new version, as after a restart); a client follows no claim topic:
        # the lookups its failing route asks for (kick) take the new version, which clears the verdict
        old = client.planner.view.get(first)
        publisher = peers[0].behaviour(ClaimPublisher)
        publisher.published = None
        publisher.refresh()
        with trio.fail_after(30):
            route = await client.planner.find_route(timeout=25)
        assert route[0].peer == first and client.planner.view.get(first).seq > old.seq
        assert not client.planner.view.following
        print(f"claims taken from gossip: {client.planner.view.from_gossip}, lookups: {client.planner.view.lookups}")


async def test_sessions_over_the_per_peer_slots_wait_in_line(loopback_config):
    lim = Limits()
    lim.set("sessions_out_per_peer=2")
    async with chain(loopback_config, [(0, 8)], limits=lim) as (_, node):
        client = Client(node, LocalModel(PATH), audit_rate=0.0)
        route = await client.planner.find_route()
        opened = trio.Event()

        async def third() -> None:
            async with client.session(8, route):
                opened.set()

        async with trio.open_nursery() as nursery:
            async with client.session(8, route), client.session(8, route):
                nursery.start_soon(third)
                await trio.sleep(0.5)
                assert not opened.is_set()  # waiting for a slot
            with trio.fail_after(30):
                await opened.wait()  # the first to go made room
        impatient = Client(node, client.model, audit_rate=0.0, queue_timeout=0.3)
        async with client.session(8, route), client.session(8, route):
            with pytest.raises(InferenceError, match="busy"):
                async with impatient.session(8, route):
                    pass


async def test_ping_streams_per_peer_is_a_limit(loopback_config):
    from shardnet.transport.host import PING_PROTOCOL

    lim = Limits()
    lim.set("ping_streams_per_peer=1")
    async with open_node(loopback_config(limits=lim)) as a, open_node(loopback_config()) as b:
        await b.connect(f"{a.listen_addrs[0]}/p2p/{a.peer_id}")
        first = await b.new_stream(a.peer_id, PING_PROTOCOL)
        await first.write(b"x" * 32)
        assert await first.read_exactly(32, timeout=5) == b"x" * 32
        second = await b.new_stream(a.peer_id, PING_PROTOCOL)  # one more than the limit: reset
        with pytest.raises(ShardnetError):
            await second.write(b"y" * 32)
            await second.read_exactly(32, timeout=5)
        await first.close()


async def test_a_restarted_peer_is_dialled_where_it_listens_now(loopback_config):
    """A peer killed (its old address still held, as identify or a DHT answer leaves it) and
    restarted with its identity on another port. py-libp2p dials one TCP address per peer, the
    first held: with the new address behind the dead one, every dial went to the dead port (the
    replica chaos test failed on it). Now a newer claim's addresses go ahead of those held, and a
    dial whose first address fails tries the next."""
    from shardnet.transport.host import PING_PROTOCOL

    async def ping(node, peer) -> None:
        with trio.fail_after(10):
            stream = await node.new_stream(peer, PING_PROTOCOL, timeout=5)
            await stream.write(b"x" * 32)
            assert await stream.read_exactly(32, timeout=5) == b"x" * 32
            await stream.close()

    async with open_node(loopback_config()) as node, open_node(loopback_config()) as other:
        async with open_node(loopback_config()) as first:
            key, old = first.key_pair, first.listen_addrs[0]
            node.learn_addrs(str(first.peer_id), [f"{old}/p2p/{first.peer_id}"], 600)
            other.host.get_peerstore().add_addrs(first.peer_id, [old], 600)
        async with open_node(loopback_config(key_pair=key, check_identity=False)) as again:
            new = again.listen_addrs[0]
            assert new != old
            # the claim's way: the new address first, the old one kept behind it
            node.learn_addrs(str(again.peer_id), [f"{new}/p2p/{again.peer_id}"], 600)
            assert node.addrs_of(again.peer_id)[0] == new and old in node.addrs_of(again.peer_id)
            await ping(node, again.peer_id)
            # the other ways (identify, DHT answers): appended behind the dead one
            other.host.get_peerstore().add_addrs(again.peer_id, [new], 600)
            assert other.addrs_of(again.peer_id) == [old, new]
            await ping(other, again.peer_id)  # (then identify replaces what it held)


async def test_a_peer_restarted_on_another_port_is_probed_where_it_listens_now(loopback_config):
    """A replica killed and restarted with its identity listens on another port. Its new claim
    (signed, with its addresses) gives the client its new address and clears the "gone" verdict
    its death earned, so routes find it again."""
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_node(loopback_config()))
        cfg = dict(bootstrap=[str(boot.listen_addrs[0])])
        second = await stack.enter_async_context(open_node(loopback_config(**cfg)))
        await stack.enter_async_context(serve_block(second, str(PATH), 4, 8))
        node = await stack.enter_async_context(open_node(loopback_config(**cfg)))
        await node.wait_bootstrapped()
        async with AsyncExitStack() as first_life:
            first = await first_life.enter_async_context(open_node(loopback_config(**cfg)))
            await first_life.enter_async_context(serve_block(first, str(PATH), 0, 4))
            client = Client(node, LocalModel(PATH))
            assert (await client.planner.find_route())[0].peer == str(first.peer_id)
            key, old_addr = first.key_pair, first.listen_addrs[0]
        probes = client.planner.probes
        await probes.probe([str(first.peer_id)], max_age=0)
        assert probes.verdict(str(first.peer_id)) == "gone"
        again = await stack.enter_async_context(open_node(loopback_config(**cfg, key_pair=key, check_identity=False)))
        assert again.peer_id == first.peer_id and again.listen_addrs[0] != old_addr
        await stack.enter_async_context(serve_block(again, str(PATH), 0, 4))
        with trio.fail_after(30):
            route = await client.planner.find_route(timeout=25)
        assert route[0].peer == str(first.peer_id)
        assert again.listen_addrs[0] in node.addrs_of(first.peer_id)
