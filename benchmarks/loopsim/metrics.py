"""What a simulated replica's /metrics shows: the server's metric names and buckets,
rendered by prometheus_client, so the loop parses them exactly as it parses a server's."""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from batchpilot import names

if TYPE_CHECKING:
    from benchmarks.loopsim.replica import ReplicaSim

# The server's buckets (server/api/metrics.py; a unit test keeps them equal), so P99s
# quantize the way real ones do.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# The loop's model inputs: the server takes these from names.py too.
TPOT_BUCKETS = names.TPOT_BUCKETS
REQUEST_TOKEN_BUCKETS = names.REQUEST_TOKEN_BUCKETS
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
        # As prometheus_client's Histogram writes them (the server's): 1 as "1.0".
        les = [*(floatToGoString(b) for b in self.bounds), "+Inf"]
        family.add_metric([MODEL_NAME], list(zip(les, cumulative, strict=True)), self.sum)
        return family


class StepCells:
    """The step-cost counters (names.STEP_COUNTERS, in that order) by (batch, phase) label,
    as the server keeps them: a label set exists once a step had it."""

    def __init__(self):
        self.cells: dict[tuple[str, str], list[float]] = {}

    def record(
        self, batch: int, seconds: float, decodes: int, prefill_tokens: int, context_tokens: int
    ) -> None:
        key = (names.step_batch_label(batch), names.step_phase_label(prefill_tokens))
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = [0.0] * len(names.STEP_COUNTERS)
        for i, value in enumerate((1, seconds, batch, decodes, prefill_tokens, context_tokens)):
            cell[i] += value

    def families(self):
        labels = [names.METRIC_LABEL, names.STEP_BATCH_LABEL, names.STEP_PHASE_LABEL]
        for i, name in enumerate(names.STEP_COUNTERS):
            family = CounterMetricFamily(name.removesuffix("_total"), name, labels=labels)
            for (batch, phase), cell in self.cells.items():
                family.add_metric([MODEL_NAME, batch, phase], cell[i])
            yield family


# The server's per-replica counters, by the key a replica keeps each under.
COUNTERS = (
    (names.NUM_PREEMPTIONS, "preemptions"),
    (names.SWAPS_OUT, "swaps_out"),
    (names.SWAPS_IN, "swaps_in"),
    (names.GENERATION_TOKENS, "gen"),
    (names.PROMPT_TOKENS, "prompt"),
    (names.REQUEST_ARRIVALS, "arrivals"),
    (names.SLO_REQUESTS, "slo_requests"),  # only with targets, as on the server
    (names.SLO_REQUESTS_MET, "slo_met"),
)


def activity_families(replica):
    """The counters ``replica.counters`` keeps (COUNTERS' keys) and the per-request
    histograms (``ttft``, ``itl``, ``tpot``, ``prompt_tokens``, ``generation_tokens``):
    what any stand-in for a server replica shows besides its gauges."""
    for name, key in COUNTERS:
        if key in replica.counters:
            family = CounterMetricFamily(
                name.removesuffix("_total"), name, labels=[names.METRIC_LABEL]
            )
            family.add_metric([MODEL_NAME], replica.counters[key])
            yield family
    yield replica.ttft.family(names.TIME_TO_FIRST_TOKEN, "time to first token")
    yield replica.itl.family(names.INTER_TOKEN_LATENCY, "inter-token latency")
    yield replica.tpot.family(names.REQUEST_TIME_PER_OUTPUT_TOKEN, "time per output token")
    yield replica.prompt_tokens.family(names.REQUEST_PROMPT_TOKENS, "prompt tokens")
    yield replica.generation_tokens.family(names.REQUEST_GENERATION_TOKENS, "output tokens")


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
            # In simulated time; a preempted sequence back in the queue counts, as it does
            # on the server.
            (names.OLDEST_WAITING_SECONDS,
             max(0.0, r.time - r.waiting[0].req.arrival) if r.waiting else 0.0),
        )  # fmt: skip
        for name, value in gauges:
            yield _gauge(name, value)
        yield from activity_families(r)
        yield from r.step_cells.families()
        info = GaugeMetricFamily(
            names.KV_CACHE_INFO, "kv", labels=[*label, "dtype", "block_size", "num_blocks"]
        )
        info.add_metric(
            [MODEL_NAME, r.kv_cache_dtype, str(r.model.block_size), str(r.num_blocks)], 1
        )
        yield info
        if r.model.graph_sizes:  # the plant pads every step with decodes (calibration.py)
            graphs = GaugeMetricFamily(names.DECODE_GRAPHS_INFO, "graphs", labels=[
                *label, names.GRAPH_SIZES_LABEL, names.GRAPH_STEPS_LABEL])  # fmt: skip
            graphs.add_metric([MODEL_NAME, ",".join(map(str, r.model.graph_sizes)),
                               names.GRAPH_STEPS_ALL], 1)  # fmt: skip
            yield graphs


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, name, labels=[names.METRIC_LABEL])
    family.add_metric([MODEL_NAME], value)
    return family
