import itertools
import statistics

import pytest

from batchpilot.server.bench.arrivals import arrival_offsets


def gaps(offsets):
    return [b - a for a, b in itertools.pairwise([0.0, *offsets])]


def test_poisson_gaps_have_mean_one_over_rate_and_unit_coefficient_of_variation():
    g = gaps(arrival_offsets(20000, request_rate=4.0, seed=1))
    assert statistics.fmean(g) == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(1.0, rel=0.05)


def test_burstiness_changes_the_spread_but_not_the_rate():
    g = gaps(arrival_offsets(20000, request_rate=2.0, seed=2, burstiness=4.0))
    assert statistics.fmean(g) == pytest.approx(0.5, rel=0.03)
    # Gamma with shape k: coefficient of variation 1/sqrt(k).
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(0.5, rel=0.05)


def test_offsets_increase_and_repeat_for_the_same_seed():
    a = arrival_offsets(100, 10.0, seed=7)
    assert all(x < y for x, y in itertools.pairwise(a)) and a[0] > 0
    assert a == arrival_offsets(100, 10.0, seed=7)
    assert a != arrival_offsets(100, 10.0, seed=8)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, float("inf"), seed=0) == [0.0] * 5
    assert arrival_offsets(0, 3.0, seed=0) == []


@pytest.mark.parametrize(
    "kwargs", [{"request_rate": 0.0}, {"request_rate": -1.0}, {"burstiness": 0.0}]
)
def test_invalid_arguments_are_rejected(kwargs):
    args = {"num_requests": 3, "request_rate": 1.0, "seed": 0, **kwargs}
    with pytest.raises(ValueError):
        arrival_offsets(**args)
