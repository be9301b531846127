"""Prefix pages' keys, scopes, rollback and eviction (server/prefix_store.py), without a model:
a page is found only by the same input rows at the same positions in the same scope."""

import pytest
import torch

from shardnet.inference.server.prefix_store import (
    PAGE,
    PrefixStore,
    PrefixTracker,
    row_digests,
    session_seed,
)
from shardnet.protocols import activation as ap


class RecordedCache:
    """What a tracker reads of a session cache: the positions' keys and values, one number each."""

    def copy_positions(self, start, end):
        return [(torch.arange(start, end, dtype=torch.float32)[None, None, :, None],) * 2]


def seed(scope="s", ret="alice"):
    return session_seed("m" * 64, (0, 4), "float32", scope, ret)


def feed(tracker, store, rows, pos=0):
    digests = row_digests(rows)
    found = tracker.lookup(store, pos, digests)
    out = rows  # the block's output rows: any tensor of the step's length
    tracker.record(digests, out, RecordedCache(), store, lambda nbytes: True)
    return found


def test_the_same_rows_find_the_pages_and_a_changed_row_stops_the_match():
    store, rows = PrefixStore(), torch.randn(1, 3 * PAGE + 1, 8)
    assert feed(PrefixTracker(seed()), store, rows) == [] and len(store) == 3
    assert len(feed(PrefixTracker(seed()), store, rows)) == 3
    changed = rows.clone()
    changed[0, PAGE + 1, 0] += 1e-6  # one element of one row of the second page
    assert len(feed(PrefixTracker(seed()), store, changed)) == 1


@pytest.mark.parametrize("other", [dict(scope="t"), dict(ret="bob")])
def test_another_scope_or_owner_finds_nothing(other):
    store, rows = PrefixStore(), torch.randn(1, 2 * PAGE + 1, 8)
    feed(PrefixTracker(seed()), store, rows)
    assert feed(PrefixTracker(seed(**other)), store, rows) == []


def test_the_shared_scope_is_the_same_for_every_owner():
    assert seed("shared", "alice") == seed("shared", "bob") != seed("s", "alice")


def test_at_least_one_row_is_left_to_compute():
    store, rows = PrefixStore(), torch.randn(1, 2 * PAGE, 8)
    feed(PrefixTracker(seed()), store, rows)
    assert len(feed(PrefixTracker(seed()), store, rows)) == 1


def test_a_rollback_across_a_page_recomputes_its_key_from_the_rows_kept():
    store, rows = PrefixStore(), torch.randn(1, 2 * PAGE + 3, 8)
    tracker = PrefixTracker(seed())
    feed(tracker, store, rows[:, :PAGE + 5])
    tracker.rollback(PAGE - 2, store)  # back into the first, complete page
    assert len(tracker.digests) == PAGE - 2 and tracker.keys == []
    feed(tracker, store, rows[:, PAGE - 2:], pos=PAGE - 2)
    assert len(tracker.keys) == 2 and len(store) == 2
    fresh = PrefixTracker(seed())
    feed(fresh, PrefixStore(), rows)
    assert fresh.keys == tracker.keys


def test_least_recently_used_pages_go_first():
    store, rows = PrefixStore(), torch.randn(1, 3 * PAGE, 8)
    feed(PrefixTracker(seed()), store, rows)
    first = next(iter(store._pages))
    store.get(first)  # used again: now the newest
    store.evict(1)
    assert first in store and len(store) == 2 and store.stats.evicted_pages == 1


@pytest.mark.parametrize("bad", ["", "x" * (ap.MAX_PREFIX_SCOPE + 1), 7])
def test_an_open_with_a_bad_prefix_scope_is_refused(bad):
    op = ap.Open(ap.new_session_id(), model="a" * 64, layers=(0, 1), max_len=8, chain=(),
                 ret=ap.PeerRef("p", []), prefix=bad)
    with pytest.raises(ap.ActivationProtocolError, match="open.prefix"):
        ap.decode_frame(ap.encode(op)[4:])


def test_an_open_prefix_round_trips():
    op = ap.Open(ap.new_session_id(), model="a" * 64, layers=(0, 1), max_len=8, chain=(),
                 ret=ap.PeerRef("p", []), prefix="shared")
    assert ap.decode_frame(ap.encode(op)[4:]).prefix == "shared"
