"""/metrics: vLLM's metric names (batchpilot/names.py), label model_name.

Gauges and counters are read from the engine's EngineStats at scrape time by a custom collector,
so they are never staler than the last engine step. Histograms, and the step-cost counters
(labelled by batch bucket and phase), are observed on the event loop from each step's
outputs and stats (one call per step, see engine/core.py's Turn).
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batchpilot import names
from batchpilot.server.engine.stats import EngineStats

# Latency buckets span a fast GPU decode (ms) to a CPU prefill of a long prompt behind a
# deep queue (minutes).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)  # fmt: skip
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Shared with the simulator (benchmarks/loopsim/metrics.py), so they live in names.py.
BATCH_BUCKETS = names.BATCH_BUCKETS
TPOT_BUCKETS = names.TPOT_BUCKETS
REQUEST_TOKEN_BUCKETS = names.REQUEST_TOKEN_BUCKETS
# The step-cost counters (names.STEP_COUNTERS, in that order) and their help.
STEP_COUNTER_HELP = (
    (names.ENGINE_STEPS, "Engine steps that ran a batch."),
    (names.ENGINE_STEP_SECONDS, "Wall seconds of those steps (schedule, forward, sample)."),
    (names.ENGINE_STEP_SEQUENCES, "Sequences in those steps (the sum of batch sizes)."),
    (names.ENGINE_STEP_DECODE_SEQUENCES, "Of those, sequences that decoded (not prefilling)."),
    (names.ENGINE_STEP_PREFILL_TOKENS, "Prompt (prefill) tokens computed in those steps."),
    (names.ENGINE_STEP_CONTEXT_TOKENS, "Decoding sequences' tokens already in the KV cache."),
)


def _counter_base(name: str) -> str:
    # prometheus_client appends "_total" to counter families itself.
    return name.removesuffix("_total")


class EngineStatsCollector:
    """Gauges and counters from the EngineStats read at scrape time (None: not loaded yet,
    so the families have no samples)."""

    # (metric name, EngineStats attribute, help)
    GAUGES = (
        (names.NUM_REQUESTS_RUNNING, "num_running", "Requests in the running batch."),
        (names.NUM_REQUESTS_WAITING, "num_waiting", "Requests waiting to be scheduled."),
        (names.NUM_REQUESTS_SWAPPED, "num_swapped", "Requests swapped out to CPU memory."),
        (names.KV_CACHE_USAGE, "kv_cache_usage", "Fraction of KV-cache blocks in use (0-1)."),
        (names.CPU_CACHE_USAGE, "cpu_cache_usage", "Fraction of CPU swap blocks in use (0-1)."),
        (names.MAX_NUM_SEQS_METRIC, "max_num_seqs", "max_num_seqs in force (admin API)."),
        (
            names.MAX_NUM_BATCHED_TOKENS_METRIC,
            "max_num_batched_tokens",
            "Step token budget in force (admin API).",
        ),
    )
    COUNTERS = (
        (names.NUM_PREEMPTIONS, "num_preemptions", "Preemptions (swap or recompute)."),
        (names.PROMPT_TOKENS, "prompt_tokens_total", "Prefill tokens processed."),
        (names.GENERATION_TOKENS, "generation_tokens_total", "Tokens generated."),
        (
            names.PREFIX_CACHE_QUERIES,
            "prefix_cache_queries",
            "Prefix cache queries, in prompt tokens looked up at admission.",
        ),
        (
            names.PREFIX_CACHE_HITS,
            "prefix_cache_hits",
            "Prefix cache hits, in prompt tokens found in cached blocks.",
        ),
        (names.SWAPS_OUT, "num_swaps_out", "Sequences swapped out to CPU memory."),
        (names.SWAPS_IN, "num_swaps_in", "Sequences swapped back in from CPU memory."),
        (names.REQUEST_ARRIVALS, "num_arrivals", "Requests accepted into the engine."),
    )

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str):
        self._stats = stats
        self._model_name = model_name

    def describe(self):
        # Declared up front so that registration checks names without reading stats.
        return self._families(None)

    def collect(self):
        return self._families(self._stats())

    def _families(self, stats: EngineStats | None):
        label = [names.METRIC_LABEL]
        for name, attr, doc in self.GAUGES:
            family = GaugeMetricFamily(name, doc, labels=label)
            if stats is not None:
                family.add_metric([self._model_name], float(getattr(stats, attr)))
            yield family
        for name, attr, doc in self.COUNTERS:
            family = CounterMetricFamily(_counter_base(name), doc, labels=label)
            if stats is not None:
                family.add_metric([self._model_name], float(getattr(stats, attr)))
            yield family
        oldest = GaugeMetricFamily(
            names.OLDEST_WAITING_SECONDS,
            "Age of the oldest request waiting to be scheduled; 0 when none waits.",
            labels=label,
        )
        if stats is not None:
            arrival = stats.oldest_waiting_arrival
            age = 0.0 if arrival is None else max(0.0, time.monotonic() - arrival)
            oldest.add_metric([self._model_name], age)
        yield oldest
        info = GaugeMetricFamily(
            names.KV_CACHE_INFO,
            "KV-cache layout in force; the value is always 1.",
            labels=[*label, "dtype", "block_size", "num_blocks"],
        )
        if stats is not None:
            info.add_metric([self._model_name, stats.kv_cache_dtype, str(stats.block_size),
                             str(stats.num_kv_blocks)], 1.0)  # fmt: skip
        yield info
        # vLLM's family, the cache config as labels (GIE's endpoint picker reads block_size
        # and num_gpu_blocks), with the model label every family here carries. num_gpu_blocks
        # is the device's KV blocks (CPU memory on a CPU server), as in vLLM's CPU backend.
        config = GaugeMetricFamily(
            names.CACHE_CONFIG_INFO,
            "Information of the KV-cache config; the value is always 1.",
            labels=[*label, "block_size", "cache_dtype", "num_gpu_blocks"],
        )
        if stats is not None:
            config.add_metric([self._model_name, str(stats.block_size), stats.kv_cache_dtype,
                               str(stats.num_kv_blocks)], 1.0)  # fmt: skip
        yield config
        if stats is not None and stats.max_lora > 0:  # max_lora is 0 with LoRA off
            yield lora_requests_info(stats)
        if stats is not None and stats.decode_graph_sizes:
            yield decode_graphs_info(self._model_name, stats.decode_graph_sizes)


def decode_graphs_info(model_name: str, sizes: tuple[int, ...]) -> GaugeMetricFamily:
    """The capture sizes of the decode-only steps' CUDA graphs (names.DECODE_GRAPHS_INFO):
    the server pads only decode-only steps (runner._forward)."""
    family = GaugeMetricFamily(names.DECODE_GRAPHS_INFO,
                               "CUDA-graph batch sizes of decode steps; the value is always 1.",
                               labels=[names.METRIC_LABEL, names.GRAPH_SIZES_LABEL,
                                       names.GRAPH_STEPS_LABEL])  # fmt: skip
    family.add_metric([model_name, ",".join(map(str, sizes)), names.STEP_PHASE_DECODE], 1.0)
    return family


def lora_requests_info(stats: EngineStats) -> GaugeMetricFamily:
    """vLLM's gauge: the adapters with running and waiting requests as comma-joined labels,
    the value the time of the update, so that a reader of several label sets takes the
    newest (GIE's picker does). vLLM keeps every label set it ever set; read at scrape time,
    this family has only the current one. Its labels are vLLM's exactly (no model_name), so
    that what reads vLLM's series reads this one unchanged."""
    family = GaugeMetricFamily(names.LORA_REQUESTS_INFO, "Running stats on lora requests.",
                               labels=["max_lora", "running_lora_adapters",
                                       "waiting_lora_adapters"])  # fmt: skip
    family.add_metric([str(stats.max_lora), ",".join(sorted(stats.running_lora_adapters)),
                       ",".join(sorted(stats.waiting_lora_adapters))], time.time())  # fmt: skip
    return family


@dataclass(frozen=True)
class SloTargets:
    """The service's targets for one request, as clients see them (names.SLO_TTFT_FLAG, SLO_TPOT_FLAG)."""

    ttft_seconds: float
    tpot_seconds: float

    def met(self, ttft: float | None, tpot: float | None) -> bool:
        """No first token misses; a request of one token has no TPOT to miss."""
        return (
            ttft is not None
            and ttft <= self.ttft_seconds
            and (tpot is None or tpot <= self.tpot_seconds)
        )


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def slo_targets(args) -> SloTargets | None:
    """The targets `serve` was given; one alone leaves the other unbounded."""
    ttft, tpot = (
        getattr(args, _dest(names.SLO_TTFT_FLAG)),
        getattr(args, _dest(names.SLO_TPOT_FLAG)),
    )
    if ttft is None and tpot is None:
        return None
    return SloTargets(math.inf if ttft is None else ttft, math.inf if tpot is None else tpot)


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        slo: SloTargets | None = None,
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(stats, model_name))
        self._model_name = model_name

        def histogram(name, doc, buckets):
            h = Histogram(name, doc, [names.METRIC_LABEL], buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.ttft = histogram(names.TIME_TO_FIRST_TOKEN, "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(names.INTER_TOKEN_LATENCY, "Time between output tokens.",
                             ITL_BUCKETS)  # fmt: skip
        self.e2e = histogram(names.E2E_REQUEST_LATENCY, "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram(names.REQUEST_QUEUE_TIME, "Arrival to first scheduled.",
                                    QUEUE_BUCKETS)  # fmt: skip
        self.iteration_tokens = histogram(names.ITERATION_TOKENS, "Tokens per engine step.",
                                          TOKEN_BUCKETS)  # fmt: skip
        self.batch_size = histogram(names.BATCH_SIZE, "Sequences per engine step.",
                                    BATCH_BUCKETS)  # fmt: skip
        self.tpot = histogram(names.REQUEST_TIME_PER_OUTPUT_TOKEN, "A finished request's mean "
                              "time per output token after its first.", TPOT_BUCKETS)  # fmt: skip
        self.prompt_tokens = histogram(names.REQUEST_PROMPT_TOKENS, "A finished request's "
                                       "prompt tokens.", REQUEST_TOKEN_BUCKETS)  # fmt: skip
        self.generation_tokens = histogram(names.REQUEST_GENERATION_TOKENS, "A finished "
                                           "request's output tokens.",
                                           REQUEST_TOKEN_BUCKETS)  # fmt: skip
        self._slo = slo
        if slo is not None:
            label = [names.METRIC_LABEL]
            self.slo_requests, self.slo_met = (
                Counter(_counter_base(name), doc, label, registry=self.registry).labels(model_name)
                for name, doc in (
                    (names.SLO_REQUESTS, "Finished requests judged against the service's SLO."),
                    (names.SLO_REQUESTS_MET, "Finished requests within both SLO targets."),
                )
            )
        step_labels = [names.METRIC_LABEL, names.STEP_BATCH_LABEL, names.STEP_PHASE_LABEL]
        self._step_counters = [
            Counter(_counter_base(name), doc, step_labels, registry=self.registry)
            for name, doc in STEP_COUNTER_HELP
        ]
        # (batch, phase) -> the step counters' children of that label set, made on first use
        # so that only label sets seen have series.
        self._step_cells: dict[tuple[str, str], list] = {}
        self._num_steps = 0  # EngineStats.num_steps of the latest step counted
        # request id -> time of its latest token, for inter-token latency.
        self._last_token_time: dict[str, float] = {}

    def observe_step(self, step) -> None:
        """Called on the event loop with each engine/core.py Turn."""
        if step.stepped:
            self.iteration_tokens.observe(step.stats.last_step_num_tokens)
            self.batch_size.observe(step.stats.last_step_batch_size)
            self._observe_step_cost(step)
        for out in step.outputs:
            self._observe_output(out, step.time)
        for rid in step.aborted:
            self._last_token_time.pop(rid, None)

    def _observe_step_cost(self, step) -> None:
        """The step-cost counters, once per step the scheduler made (a step that failed
        before scheduling left num_steps, and the last_step_* figures, as they were)."""
        stats = step.stats
        if stats.num_steps == self._num_steps or stats.last_step_batch_size <= 0:
            self._num_steps = stats.num_steps
            return
        self._num_steps = stats.num_steps
        key = (names.step_batch_label(stats.last_step_batch_size),
               names.step_phase_label(stats.last_step_prefill_tokens))  # fmt: skip
        cell = self._step_cells.get(key)
        if cell is None:
            cell = [c.labels(self._model_name, *key) for c in self._step_counters]
            self._step_cells[key] = cell
        values = (1, step.step_seconds, stats.last_step_batch_size, stats.last_step_decode_seqs,
                  stats.last_step_prefill_tokens, stats.last_step_context_tokens)  # fmt: skip
        for counter, value in zip(cell, values, strict=True):
            counter.inc(value)

    def _observe_output(self, out, now: float) -> None:
        timing = out.metrics
        num_new = len(out.outputs[0].delta_token_ids)
        if num_new:
            previous = self._last_token_time.get(out.request_id)
            if previous is None and timing.first_token_time is not None:
                self.ttft.observe(timing.first_token_time - timing.arrival_time)
                previous = timing.first_token_time
                num_new -= 1  # the first token has no inter-token gap
            if previous is not None and num_new > 0:
                gap = (now - previous) / num_new
                for _ in range(num_new):
                    self.itl.observe(gap)
            self._last_token_time[out.request_id] = now
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            if timing.finished_time is not None:
                self.e2e.observe(timing.finished_time - timing.arrival_time)
            if timing.first_scheduled_time is not None:
                self.queue_time.observe(timing.first_scheduled_time - timing.arrival_time)
            self._observe_finished(out, timing)

    def _observe_finished(self, out, timing) -> None:
        """vLLM's per-request histograms of a finished request."""
        num_output = len(out.outputs[0].token_ids)
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(num_output)
        first, finished = timing.first_token_time, timing.finished_time
        tpot = None
        if num_output >= 2 and first is not None and finished is not None:
            tpot = (finished - first) / (num_output - 1)
            self.tpot.observe(tpot)
        if self._slo is not None:
            ttft = None if first is None else first - timing.arrival_time
            self.slo_requests.inc()
            if self._slo.met(ttft, tpot):
                self.slo_met.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
