"""AutoNAT between real nodes: a node advertises the marker that puts it first, and whom it asks.
The policy alone (sans-IO): tests/unit/transport/test_autonat_ask_policy.py."""

import trio

from shardnet.transport import open_node
from shardnet.transport.nat.autonat import (
    DIAL_BACK_MARKER,
    FRESH,
    REUSES,
    UNKNOWN_KIND,
)


async def test_a_node_advertises_the_marker_and_a_node_without_autonat_client_never_asks(loopback_config):
    async with open_node(loopback_config()) as a, open_node(loopback_config(autonat_client=False)) as b:
        await b.connect(a.listen_addrs[0])
        with trio.fail_after(10):  # identify tells b what a speaks
            while DIAL_BACK_MARKER not in b.host.get_peerstore().get_protocols(a.peer_id):
                await trio.sleep(0.05)
        kinds = await b.autonat.server_kinds()
        assert kinds == {a.peer_id: FRESH}
        # on loopback b has no address to offer: a refuses to dial; b backs off from a
        await b.autonat.check()
        assert b.autonat.stats["asked"] == 1 and b.autonat.policy.backing_off(a.peer_id, trio.current_time())
        assert next(iter(b.autonat.reachability.answers.values())).startswith("E_DIAL_REFUSED")
        before = b.autonat.reachability
        assert await b.autonat.check() is before  # a is backing off: nobody asked, nothing forgotten
        assert b.autonat.stats["asked"] == 1
        assert b.autonat.stats["no_answer"] == 0 and a.peer_id in b.peers()


async def test_an_unmarked_server_is_asked_only_once_its_agent_is_known_and_not_one_that_drops_us(
        loopback_config, monkeypatch):
    from libp2p.custom_types import TProtocol

    import shardnet.transport.nat.autonat as autonat

    async with open_node(loopback_config()) as foreign, open_node(loopback_config()) as b:
        foreign.host.remove_stream_handler(TProtocol(DIAL_BACK_MARKER))  # as a non-shardnet server
        await b.connect(foreign.listen_addrs[0])
        with trio.fail_after(10):
            while "/libp2p/autonat/1.0.0" not in b.host.get_peerstore().get_protocols(foreign.peer_id):
                await trio.sleep(0.05)
        assert DIAL_BACK_MARKER not in b.host.get_peerstore().get_protocols(foreign.peer_id)
        # its agent, read with an identify exchange of b's own: py-libp2p, which dials back on a
        # fresh connection: asked
        assert await b.autonat.server_kinds() == {foreign.peer_id: UNKNOWN_KIND}
        assert b.autonat._agents[foreign.peer_id].startswith("py-libp2p")
        # were it an agent known to answer over the asked connection and close it: never asked
        monkeypatch.setattr(autonat, "REUSING_AGENTS", ("py-libp2p",))
        assert await b.autonat.server_kinds() == {foreign.peer_id: REUSES}
        assert b.autonat.policy.choose(await b.autonat.server_kinds(), trio.current_time()) == []
        await b.autonat.check()
        assert b.autonat.stats["asked"] == 0 and foreign.peer_id in b.peers()
