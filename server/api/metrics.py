"""/metrics: vLLM's metric names (batchpilot/names.py), label model_name.

Gauges and counters are read from the engine's EngineStats at scrape time by a custom collector,
so they are never staler than the last engine step. Histograms are observed on the event
loop from each step's outputs (one call per step, see engine/core.py's Turn).
"""

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
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
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


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
        (names.SWAPS_OUT, "num_swaps_out", "Sequences swapped out to CPU memory."),
        (names.SWAPS_IN, "num_swaps_in", "Sequences swapped back in from CPU memory."),
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


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
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
        # request id -> time of its latest token, for inter-token latency.
        self._last_token_time: dict[str, float] = {}

    def observe_step(self, step) -> None:
        """Called on the event loop with each engine/core.py Turn."""
        if step.stepped:
            self.iteration_tokens.observe(step.stats.last_step_num_tokens)
            self.batch_size.observe(step.stats.last_step_batch_size)
        for out in step.outputs:
            self._observe_output(out, step.time)
        for rid in step.aborted:
            self._last_token_time.pop(rid, None)

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

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
