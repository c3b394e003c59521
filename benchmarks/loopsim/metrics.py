"""What a simulated replica's /metrics shows: the server's metric names and buckets,
rendered by prometheus_client, so the loop parses them exactly as it parses a server's."""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from batchpilot import names

if TYPE_CHECKING:
    from benchmarks.loopsim.replica import ReplicaSim

# The server's buckets (server/api/metrics.py; a unit test keeps them equal), so P99s
# quantize the way real ones do.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
MODEL_NAME = names.DEFAULT_SERVED_MODEL_NAME


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)  # the first bound >= value ("le")
        self.counts[i] += n
        self.sum += value * n

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=[names.METRIC_LABEL])
        cumulative = list(itertools.accumulate(self.counts))
        les = [*(str(b) for b in self.bounds), "+Inf"]
        family.add_metric([MODEL_NAME], list(zip(les, cumulative, strict=True)), self.sum)
        return family


def metrics_text(replica: ReplicaSim) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(replica))
    return generate_latest(registry).decode()


class _Collector:
    def __init__(self, replica: ReplicaSim):
        self.r = replica

    def collect(self):
        r, label = self.r, [names.METRIC_LABEL]
        gauges = (
            (names.NUM_REQUESTS_RUNNING, r.num_running),
            (names.NUM_REQUESTS_WAITING, len(r.waiting)),
            (names.NUM_REQUESTS_SWAPPED, len(r.swapped)),
            (names.KV_CACHE_USAGE, 1 - r.free_blocks / r.num_blocks),
            (names.MAX_NUM_SEQS_METRIC, r.max_num_seqs),
            (names.MAX_NUM_BATCHED_TOKENS_METRIC, r.max_num_batched_tokens),
        )
        for name, value in gauges:
            yield _gauge(name, value)
        counters = (
            (names.NUM_PREEMPTIONS, "preemptions"),
            (names.SWAPS_OUT, "swaps_out"),
            (names.SWAPS_IN, "swaps_in"),
            (names.GENERATION_TOKENS, "gen"),
            (names.PROMPT_TOKENS, "prompt"),
        )
        for name, key in counters:
            family = CounterMetricFamily(name.removesuffix("_total"), name, labels=label)
            family.add_metric([MODEL_NAME], r.counters[key])
            yield family
        yield r.ttft.family(names.TIME_TO_FIRST_TOKEN, "time to first token")
        yield r.itl.family(names.INTER_TOKEN_LATENCY, "inter-token latency")
        info = GaugeMetricFamily(
            names.KV_CACHE_INFO, "kv", labels=[*label, "dtype", "block_size", "num_blocks"]
        )
        info.add_metric(
            [MODEL_NAME, r.kv_cache_dtype, str(r.model.block_size), str(r.num_blocks)], 1
        )
        yield info


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, name, labels=[names.METRIC_LABEL])
    family.add_metric([MODEL_NAME], value)
    return family
