"""Latency statistics as `vllm bench serve` reports them: mean, median and percentiles."""

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks,
    the same definition as numpy.percentile's default, so numbers compare with vLLM's."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(values_s: Sequence[float], name: str, percentiles: Sequence[float]) -> dict:
    """Seconds in, vLLM-style millisecond keys out: mean_ttft_ms, median_ttft_ms, p99_ttft_ms."""
    ms = [v * 1000.0 for v in values_s]
    out = {f"mean_{name}_ms": mean(ms), f"median_{name}_ms": percentile(ms, 50)}
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return out
