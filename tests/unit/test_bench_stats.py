import math
import random

import numpy as np
import pytest

from batchpilot.server.bench.stats import mean, percentile, summarize


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy_linear_definition(q):
    rng = random.Random(q)
    values = [rng.expovariate(1.0) for _ in range(101 + int(q))]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_interpolates_between_ranks():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 0.0], 25) == 2.5  # order of the input does not matter
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_nan_and_bad_q_is_rejected():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0], -1)


def test_summarize_reports_milliseconds_under_vllm_keys():
    out = summarize([0.010, 0.020, 0.030, 0.040], "ttft", (90.0, 99.0))
    assert set(out) == {"mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"}
    assert out["mean_ttft_ms"] == pytest.approx(25.0)
    assert out["median_ttft_ms"] == pytest.approx(25.0)
    assert out["p90_ttft_ms"] == pytest.approx(37.0)
    assert out["p99_ttft_ms"] == pytest.approx(39.7)


def test_mean_of_nothing_is_nan():
    assert math.isnan(mean([]))
    assert mean([1.0, 2.0]) == 1.5
