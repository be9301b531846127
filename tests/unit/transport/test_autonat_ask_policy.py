"""Whom AutoNAT asks and when (nat/autonat.AskPolicy, sans-IO: the clock is a number we pass).
A real node's side of it is tests/integration/test_autonat_policy.py."""

import random

from shardnet.transport.nat.autonat import (
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
