"""Per-peer token buckets (transport/limits.py): when a refused key may try again."""

import pytest

from shardnet.transport.limits import TokenBuckets


def test_retry_after_says_when_a_token_is_back():
    buckets = TokenBuckets(rate=2.0, burst=1)
    assert buckets.retry_after("p", now=0.0) == 0.0
    assert buckets.take("p", now=0.0) and not buckets.take("p", now=0.1)
    assert buckets.retry_after("p", now=0.1) == pytest.approx(0.4)
    assert buckets.retry_after("p", now=0.5) == 0.0 and buckets.take("p", now=0.5)
    assert buckets.retry_after("other", now=0.5) == 0.0


def test_a_bucket_that_never_refills_gives_no_time():
    buckets = TokenBuckets(rate=0.0, burst=1)
    assert buckets.take("p", now=0.0)
    assert buckets.retry_after("p", now=5.0) is None
