"""Layer ranges: which topics and provider keys a claim goes under (dissemination 2)."""

import pytest

from shardnet.protocols import block_claim as bc
from shardnet.testing import factories


@pytest.mark.parametrize("num_layers", [1, 2, 8, 16, 17, 61, 80, 126])
def test_ranges_tile_the_model(num_layers):
    ranges = bc.layer_ranges(num_layers)
    assert len(ranges) == min(num_layers, bc.CLAIM_RANGES)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a < b for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    sizes = {b - a for a, b in ranges}
    assert max(sizes) - min(sizes) <= 1


def test_ranges_of_a_span():
    # 80 layers: 16 ranges of 5
    assert bc.ranges_of(0, 5, 80) == [0]
    assert bc.ranges_of(4, 6, 80) == [0, 1]
    assert bc.ranges_of(0, 80, 80) == list(range(16))
    assert bc.ranges_of(79, 80, 80) == [15]
    # 8 layers: a range per layer
    assert bc.ranges_of(2, 4, 8) == [2, 3]


def test_neighbourhood_adds_the_layers_either_side():
    assert bc.neighbourhood(5, 10, 80) == [0, 1, 2]
    assert bc.neighbourhood(0, 5, 80) == [0, 1]
    assert bc.neighbourhood(75, 80, 80) == [14, 15]
    assert bc.neighbourhood(2, 4, 8) == [1, 2, 3, 4]


def test_a_claim_goes_on_the_ranges_of_its_span_and_of_the_span_it_loads():
    serving = factories.claim(start=5, end=10)
    assert bc.claim_ranges(serving, 80) == [1]
    moving = factories.claim(start=5, end=10, loading=(70, 80))
    assert bc.claim_ranges(moving, 80) == [1, 14, 15]
    joining = factories.claim(start=0, end=6, loading=(0, 6))  # serves nothing yet: the span it loads
    assert bc.claim_ranges(joining, 80) == [0, 1]
    assert bc.claim_ranges(factories.claim(start=2, end=4), 8) == [2, 3]


def test_range_topics_differ_from_the_model_topic():
    topics = {bc.range_topic("m", i) for i in range(3)}
    assert len(topics) == 3 and bc.topic("m") not in topics
