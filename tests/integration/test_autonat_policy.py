"""Whom AutoNAT asks and when (nat/autonat.AskPolicy, sans-IO: the clock is a number we pass),
and that a real node advertises the marker that puts it first."""

import random

import trio

from shardnet.transport import open_node
from shardnet.transport.nat.autonat import (
    DIAL_BACK_MARKER,
    FRESH,
    MAX_BACKOFF,
    NO_ANSWER_BACKOFF,
    REFUSED_BACKOFF,
    REUSES,
    UNKNOWN_KIND,
    AskPolicy,
)


def _policy(**kw):
    return AskPolicy(rng=random.Random(7), **kw)


def test_fresh_dial_back_servers_first_unknown_only_without_them_reusing_never():
    p = _policy()
    kinds = {"f1": FRESH, "f2": FRESH, "u1": UNKNOWN_KIND, "u2": UNKNOWN_KIND, "js": REUSES}
    assert sorted(p.choose(kinds, 0.0)) == ["f1", "f2"]
    assert len(p.choose(kinds, 0.0, n=1)) == 1
    # no marked server: one unknown-kind server per check, never the one that closes our connection
    only_foreign = {"u1": UNKNOWN_KIND, "u2": UNKNOWN_KIND, "js": REUSES}
    for _ in range(20):
        chosen = p.choose(only_foreign, 0.0)
        assert len(chosen) == 1 and chosen[0] in ("u1", "u2")
    assert p.choose({"js": REUSES}, 0.0) == []


def test_servers_whose_answers_came_from_dial_backs_are_preferred():
    p = _policy()
    kinds = {f"f{i}": FRESH for i in range(6)}
    p.answered("f4", 0.0, dial_back=True)
    p.answered("f5", 0.0, dial_back=True)
    for _ in range(10):
        assert set(p.choose(kinds, 1.0, n=2)) == {"f4", "f5"}


def test_a_server_that_did_not_answer_is_not_asked_again_until_its_backoff_ends_doubling():
    p = _policy()
    kinds = {"a": FRESH, "b": FRESH}
    p.no_answer("a", 100.0)
    assert p.choose(kinds, 101.0) == ["b"]
    assert p.choose(kinds, 100.0 + NO_ANSWER_BACKOFF - 1) == ["b"]
    assert sorted(p.choose(kinds, 100.0 + NO_ANSWER_BACKOFF + 1)) == ["a", "b"]
    t = 100.0 + NO_ANSWER_BACKOFF + 1
    p.no_answer("a", t)  # second time: twice as long
    assert "a" not in p.choose(kinds, t + 2 * NO_ANSWER_BACKOFF - 1)
    assert "a" in p.choose(kinds, t + 2 * NO_ANSWER_BACKOFF + 1)
    for _ in range(30):  # capped at a day
        p.no_answer("a", t)
    assert "a" in p.choose(kinds, t + MAX_BACKOFF + 1)
    # an answer ends the backoff
    p.answered("a", t, dial_back=True)
    assert "a" in p.choose(kinds, t)


def test_a_server_whose_connection_went_as_it_answered_is_left_alone_a_day():
    p = _policy()
    p.no_answer("u", 0.0, dropped=True)
    assert p.choose({"u": UNKNOWN_KIND}, MAX_BACKOFF - 1) == []
    assert p.choose({"u": UNKNOWN_KIND}, MAX_BACKOFF + 1) == ["u"]


def test_a_refusal_backs_off_for_less_than_silence():
    p = _policy()
    p.refused("a", 0.0)
    assert p.choose({"a": FRESH}, REFUSED_BACKOFF - 1) == []
    assert p.choose({"a": FRESH}, REFUSED_BACKOFF + 1) == ["a"]
    assert REFUSED_BACKOFF < NO_ANSWER_BACKOFF


def test_checks_space_out_while_unknown_and_settle_at_the_interval_once_known():
    p = _policy(retry=15.0, interval=300.0)
    delays = [p.next_delay("unknown") for _ in range(7)]
    assert delays == [15.0, 30.0, 60.0, 120.0, 240.0, 300.0, 300.0]
    assert p.next_delay("public") == 300.0
    assert p.next_delay("unknown") == 15.0  # a new spell of not knowing starts over


def test_state_is_bounded():
    p = _policy()
    for i in range(5000):
        p.no_answer(f"s{i}", 0.0)
    assert len(p.servers) <= 1024


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


def test_the_no_autonat_flag_turns_the_client_off_and_keeps_the_service():
    import click
    from click.testing import CliRunner

    from shardnet.cli import make_config, network_options

    made = []

    @click.command()
    @network_options("/ip4/127.0.0.1/tcp/0")
    def cmd(listen, announce, bootstrap, quic, mdns, relays):
        made.append(make_config(identity=None, listen=listen, announce=announce, bootstrap=bootstrap, quic=quic,
                                mdns=mdns, default_listen="/ip4/127.0.0.1/tcp/0", persistent=False, relays=relays))

    assert CliRunner().invoke(cmd, ["--no-autonat"]).exit_code == 0
    assert CliRunner().invoke(cmd, []).exit_code == 0
    assert (made[0].autonat_client, made[0].autonat) == (False, True)
    assert made[1].autonat_client is True


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
