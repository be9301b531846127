"""ClientActivity: what monitors read of a node's generations."""

import pytest

from shardnet.inference.client import activity as act
from shardnet.inference.client.activity import ClientActivity
from shardnet.inference.client.audit import AuditStats


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(act.time, "monotonic", c)
    return c


def test_tokens_per_second_counts_the_last_minute_only(clock):
    a = ClientActivity()
    for _ in range(120):
        a.token()
        clock.now += 0.5  # two a second for a minute
    assert a.tokens_total == 120
    assert a.tokens_per_s() == pytest.approx(2.0)
    assert a.tokens_per_s(10) == pytest.approx(2.0)
    clock.now += 30  # idle for half a minute: half the window is empty
    assert a.tokens_per_s() == pytest.approx(1.0, abs=0.05)
    clock.now += 61
    assert a.tokens_per_s() == 0 and a.tokens_total == 120


def test_a_retraction_is_counted_and_makes_no_token(clock):
    a = ClientActivity()
    a.token()
    a.token(made=False, retracted=1)
    assert (a.tokens_total, a.retracted_total) == (1, 1)


def test_sessions_heals_convictions_and_audits_add_up():
    a = ClientActivity()
    a.session_started(5)
    a.session_started(7)
    assert (a.sessions_active, a.sessions_total, a.prompt_tokens_total) == (2, 2, 12)
    a.healed({"phase": "decode", "failed": ["p1"], "layers": [[0, 4]]})
    a.healed({"phase": "audit", "failed": ["p2"], "layers": [[4, 8]]})
    a.session_ended(failed=False, audit=AuditStats(sampled=3, checked=2, agreed=1, convictions=1))
    a.session_ended(failed=True)
    assert (a.sessions_active, a.sessions_failed) == (0, 1)
    assert (a.heals_total, a.convictions_total) == (2, 1)
    assert [e["kind"] for e in a.events] == ["heal", "conviction"]
    assert a.audits["sampled"] == 3 and a.audits["convictions"] == 1 and a.audits["disputes"] == 0
    body = a.to_json()
    assert body["recent_events"][1]["failed"] == ["p2"] and body["heals_total"] == 2


def test_recent_events_are_bounded():
    a = ClientActivity()
    for i in range(act.RECENT_EVENTS + 10):
        a.healed({"phase": "decode", "failed": [f"p{i}"]})
    assert len(a.events) == act.RECENT_EVENTS and a.events[-1]["failed"] == [f"p{act.RECENT_EVENTS + 9}"]
    assert a.heals_total == act.RECENT_EVENTS + 10


def test_step_round_trips_land_in_the_shared_buckets():
    a = ClientActivity()
    for s in (0.001, 0.03, 0.03, 20.0):
        a.step(s)
    got = {s.labels.get("le"): s.value for m in a.step_seconds.collect() for s in m.samples
           if s.name.endswith("_bucket")}
    assert got["0.002"] == 1 and got["0.05"] == 3 and got["10.0"] == 3 and got["+Inf"] == 4
