"""Layer ranges: which topics and provider keys a claim goes under (dissemination 2)."""

import pytest

from shardnet.protocols import block_claim as bc
from shardnet.testing import factories


@pytest.mark.parametrize("num_layers", [1, 2, 7, 8, 16, 17, 61, 64, 80, 126])
def test_ranges_tile_the_model(num_layers):
    ranges = bc.layer_ranges(num_layers)
    assert len(ranges) == max(1, min(num_layers // bc.MIN_RANGE_LAYERS, bc.CLAIM_RANGES))
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(b - a >= min(num_layers, bc.MIN_RANGE_LAYERS) for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    sizes = {b - a for a, b in ranges}
    assert max(sizes) - min(sizes) <= 1


def test_ranges_of_a_span():
    # 80 layers: 16 ranges of 5
    assert bc.ranges_of(0, 5, 80) == [0]
    assert bc.ranges_of(4, 6, 80) == [0, 1]
    assert bc.ranges_of(0, 80, 80) == list(range(16))
    assert bc.ranges_of(79, 80, 80) == [15]
    # 8 layers (the shipped model): two ranges of 4
    assert bc.layer_ranges(8) == [(0, 4), (4, 8)]
    assert bc.ranges_of(2, 4, 8) == [0]
    assert bc.ranges_of(3, 5, 8) == [0, 1]


def test_a_peer_follows_its_span_and_its_successors_first_layer():
    assert bc.neighbourhood(5, 10, 80) == [1, 2]
    assert bc.neighbourhood(0, 5, 80) == [0, 1]
    assert bc.neighbourhood(75, 80, 80) == [15]
    assert bc.neighbourhood(2, 4, 8) == [0, 1]


def test_a_claim_goes_on_the_range_of_its_first_layer_and_of_the_span_it_loads():
    assert bc.claim_ranges(factories.claim(start=5, end=10), 80) == [1]
    assert bc.claim_ranges(factories.claim(start=0, end=80), 80) == [0]  # one message, however wide
    moving = factories.claim(start=5, end=10, loading=(70, 80))
    assert bc.claim_ranges(moving, 80) == [1, 14]
    joining = factories.claim(start=0, end=6, loading=(0, 6))  # serves nothing yet: the span it loads
    assert bc.claim_ranges(joining, 80) == [0]
    assert bc.claim_ranges(factories.claim(start=2, end=4), 8) == [0]


def test_every_claim_is_heard_by_its_predecessors_and_span_mates():
    """A peer ending where a claim starts, or whose span holds the claim's first layer, follows
    the range the claim is published on."""
    for L in (8, 61, 80):
        for start in range(L):
            (r,) = bc.claim_ranges(factories.claim(start=start, end=start + 1), L)
            for a in range(0, start + 1):
                assert r in bc.neighbourhood(a, start, L) if a < start else True
            assert r in bc.neighbourhood(start, start + 1, L)


def test_range_topics_differ_from_the_model_topic():
    topics = {bc.range_topic("m", i) for i in range(3)}
    assert len(topics) == 3 and bc.topic("m") not in topics
