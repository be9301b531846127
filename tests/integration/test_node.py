"""One process, several real py-libp2p hosts on loopback."""

from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from shardnet.protocols import echo
from shardnet.testing.factories import echo_handler
from shardnet.transport import open_node, records
from shardnet.transport.errors import (
    AddressError,
    DialError,
    ProtocolNotSupported,
    ShardnetError,
)
from shardnet.transport.stream import StreamClosedError


async def test_stream_between_two_nodes(loopback_config):
    async with open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        b.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        await a.connect(b.listen_addrs[0])
        async with await a.new_stream(b.peer_id, echo.PROTOCOL_ID) as s:
            assert await echo.echo_once(s, b"ping over the overlay") == b"ping over the overlay"
            big = bytes(range(256)) * 4000  # ~1 MB, more than one Yamux window
            assert await echo.echo_once(s, big[: echo.MAX_FRAME]) == big[: echo.MAX_FRAME]
        assert a.peer_id in b.peers() and b.peer_id in a.peers()


async def test_unknown_protocol_is_a_clear_error_and_the_node_stays_up(loopback_config):
    async with open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        b.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        await a.connect(b.listen_addrs[0])
        with pytest.raises(ProtocolNotSupported, match="/no/such/1.0.0"):
            await a.new_stream(b.peer_id, "/no/such/1.0.0")
        # both sides keep working afterwards
        async with await a.new_stream(b.peer_id, echo.PROTOCOL_ID) as s:
            assert await echo.echo_once(s, b"still here") == b"still here"


async def test_dead_peer_fails_fast_and_the_node_stays_up(loopback_config):
    async with open_node(loopback_config()) as a:
        async with open_node(loopback_config()) as b:
            dead_addr, dead_id = b.listen_addrs[0], b.peer_id
        with trio.fail_after(10):  # far below any sane hang; the dial itself gives the reason
            with pytest.raises(DialError, match="refused"):
                await a.connect(dead_addr)
            with pytest.raises(DialError, match="refused"):
                await a.new_stream(dead_id, echo.PROTOCOL_ID)
        async with open_node(loopback_config()) as c:
            c.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
            await a.connect(c.listen_addrs[0])
            assert await a.ping(c.peer_id) > 0


async def test_peer_dying_mid_stream_gives_a_clear_error(loopback_config):
    async with open_node(loopback_config()) as a:
        async with open_node(loopback_config()) as b:
            started = trio.Event()

            async def stall(stream):
                started.set()
                await trio.sleep_forever()

            b.set_stream_handler("/stall/1.0.0", stall)
            await a.connect(b.listen_addrs[0])
            s = await a.new_stream(b.peer_id, "/stall/1.0.0")
            await s.write(b"x")
            await started.wait()
        # b is gone: the read must end promptly with an error, not hang
        with trio.fail_after(15):
            with pytest.raises(ShardnetError):
                data = await s.read_exactly(10, timeout=10)
                assert not data


async def test_malformed_multiaddrs(loopback_config):
    async with open_node(loopback_config()) as a:
        for bad in ("/ip4/1.2.3/tcp/1", "not-an-addr", "/ip4/127.0.0.1/tcp/1"):
            with pytest.raises(AddressError):
                await a.connect(bad)
    with pytest.raises(AddressError, match="--listen"):
        async with open_node(loopback_config(listen=["/ip4/127.0.0.1/tcp/x"])):
            pass


async def test_handler_exception_resets_only_that_stream(loopback_config):
    async with open_node(loopback_config()) as a, open_node(loopback_config()) as b:
        async def boom(stream):
            await stream.read_some()
            raise RuntimeError("handler bug")

        b.set_stream_handler("/boom/1.0.0", boom)
        b.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        await a.connect(b.listen_addrs[0])
        s = await a.new_stream(b.peer_id, "/boom/1.0.0")
        await s.write(b"trigger")
        with pytest.raises(StreamClosedError):  # reset (or at least ended), never a hang
            await s.read_exactly(1, timeout=5)
        async with await a.new_stream(b.peer_id, echo.PROTOCOL_ID) as s2:
            assert await echo.echo_once(s2, b"ok") == b"ok"


@asynccontextmanager
async def bootstrapped_nodes(loopback_config, n):
    """A bootstrap node and ``n`` nodes joined through it, all in this process."""
    async with open_node(loopback_config()) as boot, AsyncExitStack() as stack:
        cfg = loopback_config(bootstrap=[str(boot.listen_addrs[0])])
        nodes = [await stack.enter_async_context(open_node(cfg)) for _ in range(n)]
        for node in nodes:
            await node.wait_bootstrapped()
        yield nodes


async def test_dht_signed_values_and_providers(loopback_config):
    from shardnet.transport import records

    async with bootstrapped_nodes(loopback_config, 3) as (a, b, c):
        published = await a.dht.put("greeting", b"hello v1")
        assert published.key == records.record_key(a.peer_id, "greeting") and published.peers >= 1
        assert await c.dht.get(a.peer_id, "greeting") == b"hello v1"
        await a.dht.put("greeting", b"hello v2")
        assert await c.dht.get(a.peer_id, "greeting") == b"hello v2"
        assert await c.dht.get(b.peer_id, "greeting") is None
        # providers: a provides twice, b once; every provider appears exactly once
        assert await a.dht.provide("model/abc") >= 1
        await a.dht.provide("model/abc")
        await b.dht.provide("model/abc")
        provs = await c.dht.find_providers("model/abc")
        ids = [p.peer_id for p in provs]
        assert sorted(map(str, ids)) == sorted([str(a.peer_id), str(b.peer_id)])
        # fewer than k servers: one walk finds them all, and asking them finds the same providers
        servers = await c.dht.servers_if_few()
        assert servers is not None and {a.peer_id, b.peer_id} <= set(servers)
        asked = await c.dht.find_providers("model/abc", closest=servers)
        assert sorted(str(p.peer_id) for p in asked) == sorted([str(a.peer_id), str(b.peer_id)])


async def test_a_put_walks_again_only_when_the_routing_table_changed(loopback_config):
    """A refresh of the same record goes to the servers the last walk found (dht.WALK_REUSE_S)
    while the routing table holds the same peers; a peer joining makes the next one walk, and
    the new peer stores it. (Below dht.MIN_TABLE_FOR_REUSE peers in the table every put walks.)"""
    async with bootstrapped_nodes(loopback_config, 6) as (a, b, c, *others):
        for n in (b, c, *others):
            await a.connect(n.listen_addrs[0])
        with trio.fail_after(10):
            while len(a.dht.routing_table_peers()) < 5:
                for n in (b, c, *others):
                    await a.dht.add_peer(n.peer_id)
                await trio.sleep(0.1)
        await a.dht.put("claim", b"v1")
        await a.dht.put("claim", b"v1")  # the first walk may fill the table: settle it
        walks, saved = a.dht.walks, a.dht.walks_saved
        assert (await a.dht.put("claim", b"v2")).peers >= 1
        assert (a.dht.walks, a.dht.walks_saved) == (walks, saved + 1)
        assert await c.dht.get(a.peer_id, "claim") == b"v2"
        # a peer the walk named could not be dialled (it may have restarted on another port, the
        # table looking the same): the next put walks again, and the one after reuses that walk
        a.dht.unreachable(c.peer_id)
        await a.dht.put("claim", b"v2")
        a.dht.unreachable(c.peer_id)  # (again within dht.UNREACHABLE_REWALK_S: no walk more)
        await a.dht.put("claim", b"v2")
        assert (a.dht.walks, a.dht.walks_saved) == (walks + 1, saved + 2)
        walks += 1
        async with open_node(loopback_config(bootstrap=[str(b.listen_addrs[0])])) as d:
            await d.wait_bootstrapped()
            await a.connect(d.listen_addrs[0])
            with trio.fail_after(10):
                while d.peer_id not in a.dht.routing_table_peers():
                    await a.dht.add_peer(d.peer_id)
                    await trio.sleep(0.1)
            await a.dht.put("claim", b"v3")
            assert a.dht.walks == walks + 1
            assert d.dht.kad.value_store.get(records.record_key(a.peer_id, "claim").encode()) is not None


async def test_provider_replies_are_bounded_random_samples(loopback_config):
    """A node holding 30 providers of a key (upstream held the first 20 and dropped the rest)
    answers each GET_PROVIDERS with a random sample of at most 20 of them, another sample each
    time; find_providers samples ``count`` of what it found (compat fix 18)."""
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    from shardnet.transport.compat import kad as compat_kad
    from shardnet.transport.dht import provider_key
    from shardnet.transport.identity import generate

    async with open_node(loopback_config()) as holder:
        key = bytes.fromhex(provider_key("model/many"))
        ids = {ID.from_pubkey(generate().public_key) for _ in range(30)}
        store = holder.dht.kad.provider_store
        for pid in ids:
            store.add_provider(key, PeerInfo(pid, []))  # as ADD_PROVIDER requests do
        assert len(store.providers[key]) == 30  # all held
        async with open_node(loopback_config(bootstrap=[str(holder.listen_addrs[0])])) as asker:
            await asker.wait_bootstrapped()
            replies = []
            for _ in range(4):
                providers, _closer = await compat_kad.providers_from_peer(
                    asker.dht.kad.provider_store, holder.peer_id, key)
                replies.append(frozenset(p.peer_id for p in providers))
            assert all(len(r) == 20 and r <= ids for r in replies)
            assert len(set(replies)) > 1  # another sample each time (the same four: 1 in 10^24)
            found = [frozenset(p.peer_id for p in await asker.dht.find_providers("model/many", count=5))
                     for _ in range(3)]
            assert all(len(f) == 5 and f <= ids for f in found) and len(set(found)) > 1
            # each peer's answer as it comes, unsampled (``shardnet status`` asks each provider
            # named at once, not after the slowest DHT peer answered)
            answers = []
            last = await asker.dht.find_providers("model/many", count=400, on_answer=answers.append)
            assert len(answers) == 1 and len(answers[0]) == 20
            assert {p.peer_id for p in answers[0]} == {p.peer_id for p in last}


async def test_publishing_with_no_peer_to_store_at_says_so(loopback_config):
    """A record only this node holds is one nobody else finds: put and provide say so, one line,
    before bootstrap (and still keep it here, where a later peer may ask)."""
    from shardnet.errors import NotStoredError

    async with open_node(loopback_config()) as alone:
        with pytest.raises(NotStoredError, match="no DHT peer to store it at .*wait_bootstrapped first"):
            await alone.dht.put("greeting", b"hello")
        with pytest.raises(NotStoredError, match="provider record 'room/1': no DHT peer"):
            await alone.dht.provide("room/1")
        assert await alone.dht.get(alone.peer_id, "greeting") == b"hello"


async def test_forged_dht_value_is_rejected_by_remote_peers(loopback_config):
    from shardnet.transport import records

    async with bootstrapped_nodes(loopback_config, 3) as (victim, attacker, reader):
        key = records.record_key(victim.peer_id, "claim")
        forged = records.encode(attacker.key_pair, "claim", b"i am the victim", key=key)
        genuine = records.encode(victim.key_pair, "claim", b"the real claim")
        for src, dst in ((attacker, reader), (attacker, victim), (victim, reader)):
            await src.connect(dst.listen_addrs[0])  # so a refusal below can only be validation
        # The attacker skips its own validator and sends PUT_VALUE straight to the others.
        for target in (reader, victim):
            with trio.move_on_after(10):
                accepted = await attacker.dht.kad.value_store._store_at_peer(
                    target.peer_id, key.encode(), forged)
            assert not accepted
            assert target.dht.kad.value_store.get(key.encode()) is None
        # the same path accepts the genuine record, so the refusal above is the validator's
        with trio.move_on_after(10):
            assert await victim.dht.kad.value_store._store_at_peer(reader.peer_id, key.encode(), genuine)
        assert await reader.dht.get(victim.peer_id, "claim") == b"the real claim"


async def test_pubsub_between_three_nodes(loopback_config):
    async with bootstrapped_nodes(loopback_config, 3) as (a, b, c):
        async with b.pubsub.subscribe("t") as sb, c.pubsub.subscribe("t") as sc:
            with trio.fail_after(20):
                while not (a.pubsub.topic_peers("t") and len(b.pubsub.topic_peers("t")) >= 1):
                    await trio.sleep(0.1)
            await a.pubsub.publish("t", b"hi all")
            for sub in (sb, sc):
                m = await sub.receive(timeout=10)
                assert (m.data, m.sender, m.topic) == (b"hi all", a.peer_id, "t")


async def test_bootstrap_reconnects_after_restart(loopback_config, tmp_path):
    from shardnet.testing.helpers import free_port
    from shardnet.transport import identity

    kp = identity.generate()
    port = free_port()
    boot_cfg = lambda: loopback_config(key_pair=kp, listen=[f"/ip4/127.0.0.1/tcp/{port}"])  # noqa: E731
    boot_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{identity.peer_id_of(kp)}"
    cfg = loopback_config(bootstrap=[boot_addr], reconnect_initial=0.1, reconnect_max=0.5)
    async with open_node(cfg) as a:
        async with open_node(boot_cfg()):
            await a.wait_bootstrapped(5, fail_fast=False)
        with trio.fail_after(5):
            while identity.peer_id_of(kp) in a.peers():
                await trio.sleep(0.05)
        async with open_node(boot_cfg()):
            # reconnection happens on the node's own backoff, not py-libp2p's 60 s negative cache
            await a.wait_bootstrapped(10, fail_fast=False)


async def test_quic_transport_behind_a_flag(loopback_config):
    cfg = lambda: loopback_config(listen=["/ip4/127.0.0.1/udp/0/quic-v1"], enable_quic=True)  # noqa: E731
    async with open_node(cfg()) as a, open_node(cfg()) as b:
        assert "/quic-v1/" in str(b.listen_addrs[0])
        b.set_stream_handler(echo.PROTOCOL_ID, echo.serve)
        await a.connect(b.listen_addrs[0])
        async with await a.new_stream(b.peer_id, echo.PROTOCOL_ID) as s:
            assert await echo.echo_once(s, b"over quic") == b"over quic"
        assert await a.ping(b.peer_id) > 0


async def test_peer_events_report_connections(loopback_config):
    async with open_node(loopback_config(low_watermark=0)) as a:
        async with a.peer_events() as events:
            async with open_node(loopback_config(low_watermark=0)) as b:
                await b.connect(a.listen_addrs[0])
                seen = []
                with trio.fail_after(10):
                    while ("connected", b.peer_id) not in seen:
                        ev = await events.receive()
                        seen.append((ev.kind, ev.peer_id))
            with trio.fail_after(10):
                while ("disconnected", b.peer_id) not in seen:
                    ev = await events.receive()
                    seen.append((ev.kind, ev.peer_id))
        assert seen.index(("connected", b.peer_id)) < seen.index(("disconnected", b.peer_id))


async def test_only_noise_is_accepted(loopback_config):
    """py-libp2p offers /plaintext/2.0.0 by default, where a peer states any public key and
    proves nothing: a shardnet node neither offers nor accepts it."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.insecure.transport import (
        PLAINTEXT_PROTOCOL_ID,
        InsecureTransport,
    )
    from multiaddr import Multiaddr

    async with open_node(loopback_config()) as node, open_node(loopback_config()) as other:
        await other.connect(f"{node.listen_addrs[0]}/p2p/{node.peer_id}")
        conn = other.host.get_network().get_connections(node.peer_id)[0]
        secured = conn.muxed_conn.secured_conn
        assert getattr(secured, "negotiated_security_protocol", None) == "/noise"

        kp = create_new_key_pair()
        plain = new_host(key_pair=kp, sec_opt={TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(kp)})
        async with plain.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            with pytest.raises(Exception), trio.fail_after(10):
                await plain.connect(info_from_p2p_addr(Multiaddr(f"{node.listen_addrs[0]}/p2p/{node.peer_id}")))
            assert plain.get_id() not in node.host.get_connected_peers()


async def test_garbage_on_a_libp2p_protocol_resets_only_that_stream(loopback_config):
    """Gossipsub lets protobuf's DecodeError out of its handler on a garbage RPC, which went up
    through the connection and ended the whole node (found by the hostile-peer test)."""
    async with open_node(loopback_config()) as victim, open_node(loopback_config()) as peer:
        victim.set_stream_handler("/t/echo", echo_handler)
        await peer.connect(f"{victim.listen_addrs[0]}/p2p/{victim.peer_id}")
        for proto in ("/meshsub/1.1.0", "/ipfs/kad/1.0.0", "/ipfs/id/push/1.0.0", "/libp2p/autonat/1.0.0"):
            s = await peer.new_stream(victim.peer_id, proto)
            await s.write(b"\x10" + b"\xff" * 16)  # a varint length, then no valid protobuf
            await trio.sleep(0.2)
        s = await peer.new_stream(victim.peer_id, "/t/echo")
        await s.write(b"still here")
        assert await s.read_some(timeout=5) == b"still here"


async def test_pings_are_answered_in_order_and_in_batches(loopback_config):
    async with open_node(loopback_config()) as node, open_node(loopback_config()) as peer:
        await peer.connect(f"{node.listen_addrs[0]}/p2p/{node.peer_id}")
        assert await peer.ping(node.peer_id) > 0  # one ping, as every libp2p peer sends it
        s = await peer.new_stream(node.peer_id, "/ipfs/ping/1.0.0")
        sent = bytes(range(256)) * 32  # 256 pings at once, then half of one more
        await s.write(sent + b"x" * 16)
        got = b""
        with trio.fail_after(5):
            while len(got) < len(sent):
                got += await s.read_some(timeout=5)
        assert got == sent
        limit = node.config.limits.ping_streams_per_peer
        extra = [await peer.new_stream(node.peer_id, "/ipfs/ping/1.0.0") for _ in range(limit)]
        await extra[-1].write(b"p" * 32)  # one ping stream over the per-peer limit is refused
        try:
            answer = await extra[-1].read_some(timeout=5)
        except ShardnetError:
            answer = b""
        assert answer == b""


async def test_the_dht_leaves_its_routing_table_refresh_to_discovery(loopback_config):
    """Compat fix 19: py-libp2p's DHT walked once per non-empty bucket every 10 minutes, beside
    discovery's own walks; its loop now sleeps an hour between rounds and its refresh walks no
    more, while discovery walks (towards our ID and a random one) and fills the table."""
    import inspect

    from libp2p.kad_dht import kad_dht

    async with open_node(loopback_config()) as boot, \
            open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])])) as a, \
            open_node(loopback_config(bootstrap=[str(boot.listen_addrs[0])])) as b:
        assert kad_dht.ROUTING_TABLE_REFRESH_INTERVAL == 3600
        # the loop reads the module's name each round, so the patched value is the one it sleeps
        loop = inspect.getsource(kad_dht.KadDHT._run_main_loop)
        assert "await trio.sleep(ROUTING_TABLE_REFRESH_INTERVAL)" in loop
        routing, walks = a.dht.kad.peer_routing, []
        walk = routing.find_closest_peers_network

        async def counted(*args, **kwargs):
            walks.append(args)
            return await walk(*args, **kwargs)

        routing.find_closest_peers_network = counted
        await a.dht.kad.refresh_routing_table()
        assert walks == []  # upstream: one walk for our ID, one per non-empty bucket
        with trio.fail_after(20):  # discovery's walks found b for a's table all the same
            while b.peer_id not in a.dht.routing_table_peers():
                await trio.sleep(0.1)


async def test_a_peer_record_is_checked_once(loopback_config):
    """Compat fix 20: a signed peer record arriving in DHT messages again (the same bytes) is
    not unpacked and checked again; a record with a bad signature is refused every time."""
    from libp2p.kad_dht import utils
    from libp2p.peer.envelope import Envelope
    from libp2p.peer.peerstore import env_to_send_in_RPC

    async with open_node(loopback_config()) as a:
        data, _ = env_to_send_in_RPC(a.host)
        checks = []
        validate = Envelope.validate

        def counted(self, domain):
            checks.append(domain)
            return validate(self, domain)

        Envelope.validate = counted
        try:
            first = utils.consume_envelope(data, "libp2p-peer-record")
            again = utils.consume_envelope(data, "libp2p-peer-record")
            assert len(checks) == 1 and again[1].peer_id == first[1].peer_id == a.peer_id
            forged = bytearray(data)
            forged[-1] ^= 1  # the signature's last byte
            for _ in range(2):
                with pytest.raises(Exception):
                    utils.consume_envelope(bytes(forged), "libp2p-peer-record")
            assert len(checks) == 3
        finally:
            Envelope.validate = validate
