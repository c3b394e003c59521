"""What the closed loop sees: each replica's /metrics text, parsed and windowed.

``Observer`` keeps, per service and per replica, the parsed samples of the last
``window_seconds`` and turns them into a ``Window``: gauges averaged over the window,
counter rates (resets handled as Prometheus' ``increase`` does) and latency P99s from
histogram bucket deltas, from families read as ``prometheus_client.parser`` reads them
(exposition.py). A replica whose scrape failed (scrape.py), or whose answer is not the
server's metrics, is skipped and counted, never raised. The step-cost cells are
observe_steps.py's, the adapters observe_lora.py's.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from batchpilot import names
from batchpilot.operator.bounds import clip
from batchpilot.operator.loop import exposition, observe_steps
from batchpilot.operator.loop.exposition import COUNTERS, GAUGES, HISTOGRAMS, wanted_lines
from batchpilot.operator.loop.observe_lora import LoraInfo, newest_lora
from batchpilot.operator.loop.observe_steps import NO_PADDING, Padding, StepCell, StepKey

if TYPE_CHECKING:
    from batchpilot.operator.loop.scrape import Scrape

DEFAULT_WINDOW_SECONDS = 60.0

Buckets = tuple[tuple[float, float], ...]  # ((upper bound "le", cumulative count), ...)


# --------------------------------------------------------------------------- parsing


class MalformedMetrics(ValueError):
    """The text is not Prometheus exposition, or not a batchpilot server's."""


@dataclass(frozen=True)
class Sample:
    """One replica's metrics at one time, summed over label sets (one model per server)."""

    time: float
    gauges: dict[str, float]
    counters: dict[str, float]
    buckets: dict[str, Buckets]
    kv_cache_dtype: str | None = None
    lora: LoraInfo | None = None
    sums: dict[str, float] = field(default_factory=dict)  # histogram name -> its _sum
    steps: dict[StepKey, list[float]] = field(default_factory=dict)  # observe_steps.py
    kv_num_blocks: int | None = None  # kv_cache_info's labels
    kv_block_size: int | None = None
    padding: Padding = NO_PADDING  # decode_graphs_info's labels


def _add(into: dict[Any, float], key: Any, value: float) -> None:
    into[key] = into.get(key, 0.0) + value


def _optional_int(labels: dict[str, str], key: str) -> int | None:
    return int(labels[key]) if labels.get(key, "").isdigit() else None  # odd: unknown


def parse_metrics(text: str, now: float) -> Sample:
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {h: {} for h in HISTOGRAMS}
    sums: dict[str, float] = {}
    steps: dict[StepKey, list[float]] = {}
    lora, info, padding = None, {}, NO_PADDING
    try:
        for family in exposition.parse_families(wanted_lines(text)):
            if family.name == names.LORA_REQUESTS_INFO:
                lora = newest_lora(family.samples)
                continue
            for s in family.samples:
                if s.name in GAUGES:
                    _add(gauges, s.name, s.value)
                elif s.name in COUNTERS:
                    _add(counters, s.name, s.value)
                elif s.name.endswith("_bucket") and family.name in buckets:
                    _add(buckets[family.name], float(s.labels["le"]), s.value)
                elif s.name.endswith("_sum") and family.name in buckets:
                    _add(sums, family.name, s.value)
                elif s.name == names.KV_CACHE_INFO:
                    info = s.labels
                elif s.name == names.DECODE_GRAPHS_INFO:
                    padding = Padding.of(s.labels)
                else:
                    observe_steps.add_step_sample(steps, s)
        num_blocks, block_size = (_optional_int(info, k) for k in ("num_blocks", "block_size"))
    except (ValueError, KeyError, TypeError) as e:
        raise MalformedMetrics(f"unparseable metrics: {e}") from e
    if names.NUM_REQUESTS_RUNNING not in gauges:
        raise MalformedMetrics(f"no {names.NUM_REQUESTS_RUNNING}: not a batchpilot server")
    return Sample(
        time=now,
        gauges=gauges,
        counters=counters,
        buckets={h: tuple(sorted(b.items())) for h, b in buckets.items()},
        kv_cache_dtype=info.get("dtype"),
        lora=lora,
        sums=sums,
        steps=steps,
        kv_num_blocks=num_blocks,
        kv_block_size=block_size,
        padding=padding,
    )


# --------------------------------------------------------------------------- windows


def increase(values: Sequence[float]) -> float:
    """A counter's increase over consecutive readings; a drop means the process restarted
    and counted from zero again (Prometheus' ``increase``)."""
    return sum(cur - prev if cur >= prev else cur for prev, cur in pairwise(values))


def bucket_increase(readings: Sequence[Buckets]) -> Buckets:
    """Per-bucket increase of a cumulative histogram over consecutive readings. A reset is
    judged on the whole histogram, so its buckets stay consistent with each other."""
    if not readings:
        return ()
    les = [le for le, _ in readings[-1]]
    total = dict.fromkeys(les, 0.0)
    for prev, cur in pairwise(readings):
        before, after = dict(prev), dict(cur)
        reset = any(after.get(le, 0.0) < before.get(le, 0.0) for le in les)
        for le in les:
            base = 0.0 if reset else before.get(le, 0.0)
            total[le] += after.get(le, 0.0) - base
    return tuple(total.items())


def merge_buckets(parts: Iterable[Buckets]) -> Buckets:
    total: dict[float, float] = {}
    for part in parts:
        for le, count in part:
            total[le] = total.get(le, 0.0) + count
    return tuple(sorted(total.items()))


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds the q-th
    observation; in the +Inf bucket, the largest finite bound. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


@dataclass(frozen=True)
class Window:
    """Metrics over a time window, for one replica or summed over a service's replicas.

    Queue and batch gauges are means over the window, summed over replicas; KV usage is the
    fullest replica's mean (memory decisions must hold for every replica); rates are per
    minute (events) or per second (tokens), summed over replicas."""

    replicas: int
    span_seconds: float
    waiting: float
    running: float
    swapped: float
    kv_cache_usage: float
    kv_cache_usage_peak: float  # the fullest sample of the fullest replica
    preemptions_per_minute: float
    swaps_per_minute: float
    generation_tokens_per_second: float
    waiting_now: float = 0.0  # the latest scrape's queue, summed over replicas
    running_now: float = 0.0
    # The latest scrape's generation-token counters, summed: work done between two scrapes
    # of a replica that started after the window's first (no rate yet) still moves it.
    generation_tokens_total: float = 0.0
    ttft_buckets: Buckets = ()
    itl_buckets: Buckets = ()
    max_num_seqs: dict[str, int] = field(default_factory=dict)  # replica URL -> in force
    max_num_batched_tokens: dict[str, int] = field(default_factory=dict)
    kv_cache_dtype: dict[str, str] = field(default_factory=dict)
    # The share of scrapes in which requests waited for an adapter with every LoRA slot
    # taken and batch slots free (LoraInfo.bottleneck); a mean over replicas when merged.
    lora_bottleneck: float = 0.0
    max_loras: dict[str, int] = field(default_factory=dict)  # replica URL -> in force
    # For the loop's models of workload and step time, per finished request: its mean time
    # per output token after the first (2+ tokens), its prompt and output lengths (and sums).
    tpot_buckets: Buckets = ()
    prompt_tokens_buckets: Buckets = ()
    output_tokens_buckets: Buckets = ()
    prompt_tokens_sum: float = 0.0
    output_tokens_sum: float = 0.0
    requests_finished: float = 0.0
    # Finished requests the server judged against the SLO it was given, and those within
    # both targets (exact where a histogram bucket straddles a target); 0 without targets.
    slo_requests: float = 0.0
    slo_requests_met: float = 0.0
    arrivals_per_second: float = 0.0  # requests accepted, summed over replicas
    oldest_waiting_seconds: float = 0.0  # the latest scrape's; the longest over replicas
    steps: tuple[StepCell, ...] = ()  # step-cost increases by (batch_le, phase)
    kv_num_blocks: dict[str, int] = field(default_factory=dict)  # replica URL -> KV blocks
    kv_block_size: int | None = None  # the value most replicas report
    padding: Padding = NO_PADDING  # how the latest scrape says steps are padded

    @property
    def ttft_p99(self) -> float | None:
        return histogram_quantile(0.99, self.ttft_buckets)

    @property
    def itl_p99(self) -> float | None:
        return histogram_quantile(0.99, self.itl_buckets)

    @property
    def tpot_p90(self) -> float | None:
        return histogram_quantile(0.9, self.tpot_buckets)

    def per_replica(self, total: float) -> float:
        return total / self.replicas if self.replicas else 0.0

    @property
    def max_num_seqs_in_force(self) -> int | None:
        """The value most replicas report (they differ only while a change rolls out)."""
        return _most_common(self.max_num_seqs.values())

    @property
    def kv_cache_dtype_in_force(self) -> str | None:
        return _most_common(self.kv_cache_dtype.values())

    def summary(self) -> dict:
        """The window as status.metrics shows it (camelCase, rounded)."""
        out = {
            "replicasScraped": self.replicas,
            "windowSeconds": round(self.span_seconds, 1),
            "queueLength": round(self.waiting, 2),
            "running": round(self.running, 2),
            "swapped": round(self.swapped, 2),
            "kvCacheUsage": round(self.kv_cache_usage, 3),
            "preemptionsPerMinute": round(self.preemptions_per_minute, 2),
            "swapsPerMinute": round(self.swaps_per_minute, 2),
            "generationTokensPerSecond": round(self.generation_tokens_per_second, 1),
        }
        quantiles = (
            ("ttftP99Seconds", self.ttft_p99),
            ("itlP99Seconds", self.itl_p99),
            ("tpotP90Seconds", self.tpot_p90),
        )
        for key, value in quantiles:
            if value is not None:
                out[key] = round(value, 4)
        return out


def _most_common(values: Iterable[Any]) -> Any:
    counts = Counter(values).most_common(1)
    return counts[0][0] if counts else None


def replica_window(url: str, samples: Sequence[Sample]) -> Window:
    first, last = samples[0], samples[-1]
    span = last.time - first.time

    def mean(name: str) -> float:
        return sum(s.gauges.get(name, 0.0) for s in samples) / len(samples)

    def rate(counter: str) -> float:
        if span <= 0:
            return 0.0
        return increase([s.counters.get(counter, 0.0) for s in samples]) / span

    mns = last.gauges.get(names.MAX_NUM_SEQS_METRIC)
    budget = last.gauges.get(names.MAX_NUM_BATCHED_TOKENS_METRIC)
    starved = [
        s.lora.bottleneck(
            s.gauges.get(names.NUM_REQUESTS_RUNNING, 0.0), s.gauges.get(names.MAX_NUM_SEQS_METRIC)
        )
        for s in samples
        if s.lora is not None
    ]

    def counted(counter: str) -> float:
        return increase([s.counters.get(counter, 0.0) for s in samples])

    return Window(
        replicas=1,
        span_seconds=span,
        waiting=mean(names.NUM_REQUESTS_WAITING),
        running=mean(names.NUM_REQUESTS_RUNNING),
        swapped=mean(names.NUM_REQUESTS_SWAPPED),
        kv_cache_usage=mean(names.KV_CACHE_USAGE),
        kv_cache_usage_peak=max(s.gauges.get(names.KV_CACHE_USAGE, 0.0) for s in samples),
        preemptions_per_minute=60 * rate(names.NUM_PREEMPTIONS),
        swaps_per_minute=60 * rate(names.SWAPS_OUT),  # sequences evicted to CPU memory
        generation_tokens_per_second=rate(names.GENERATION_TOKENS),
        waiting_now=last.gauges.get(names.NUM_REQUESTS_WAITING, 0.0),
        running_now=last.gauges.get(names.NUM_REQUESTS_RUNNING, 0.0),
        generation_tokens_total=last.counters.get(names.GENERATION_TOKENS, 0.0),
        ttft_buckets=bucket_increase([s.buckets[names.TIME_TO_FIRST_TOKEN] for s in samples]),
        itl_buckets=bucket_increase([s.buckets[names.INTER_TOKEN_LATENCY] for s in samples]),
        max_num_seqs={url: int(mns)} if mns is not None else {},
        max_num_batched_tokens={url: int(budget)} if budget is not None else {},
        kv_cache_dtype={url: last.kv_cache_dtype} if last.kv_cache_dtype else {},
        lora_bottleneck=sum(starved) / len(starved) if starved else 0.0,
        max_loras={url: last.lora.max_loras} if last.lora else {},
        arrivals_per_second=rate(names.REQUEST_ARRIVALS),
        slo_requests=counted(names.SLO_REQUESTS),
        slo_requests_met=counted(names.SLO_REQUESTS_MET),
        **_model_inputs(url, samples),
    )


def _model_inputs(url: str, samples: Sequence[Sample]) -> dict[str, Any]:
    """One replica's Window fields for the loop's models of the workload and step time."""
    last = samples[-1]

    def histogram(name: str) -> Buckets:
        return bucket_increase([s.buckets.get(name, ()) for s in samples])

    def total(name: str) -> float:
        return increase([s.sums.get(name, 0.0) for s in samples])

    output = histogram(names.REQUEST_GENERATION_TOKENS)
    return dict(
        tpot_buckets=histogram(names.REQUEST_TIME_PER_OUTPUT_TOKEN),
        prompt_tokens_buckets=histogram(names.REQUEST_PROMPT_TOKENS),
        output_tokens_buckets=output,
        prompt_tokens_sum=total(names.REQUEST_PROMPT_TOKENS),
        output_tokens_sum=total(names.REQUEST_GENERATION_TOKENS),
        requests_finished=output[-1][1] if output else 0.0,
        oldest_waiting_seconds=last.gauges.get(names.OLDEST_WAITING_SECONDS, 0.0),
        steps=observe_steps.step_increase([s.steps for s in samples]),
        kv_num_blocks={url: last.kv_num_blocks} if last.kv_num_blocks is not None else {},
        kv_block_size=last.kv_block_size,
        padding=last.padding,
    )


def merge_windows(windows: Sequence[Window]) -> Window | None:
    if not windows:
        return None
    return Window(
        replicas=sum(w.replicas for w in windows),
        span_seconds=max(w.span_seconds for w in windows),
        waiting=sum(w.waiting for w in windows),
        running=sum(w.running for w in windows),
        swapped=sum(w.swapped for w in windows),
        kv_cache_usage=max(w.kv_cache_usage for w in windows),
        kv_cache_usage_peak=max(w.kv_cache_usage_peak for w in windows),
        preemptions_per_minute=sum(w.preemptions_per_minute for w in windows),
        swaps_per_minute=sum(w.swaps_per_minute for w in windows),
        generation_tokens_per_second=sum(w.generation_tokens_per_second for w in windows),
        waiting_now=sum(w.waiting_now for w in windows),
        running_now=sum(w.running_now for w in windows),
        generation_tokens_total=sum(w.generation_tokens_total for w in windows),
        ttft_buckets=merge_buckets(w.ttft_buckets for w in windows),
        itl_buckets=merge_buckets(w.itl_buckets for w in windows),
        max_num_seqs={k: v for w in windows for k, v in w.max_num_seqs.items()},
        max_num_batched_tokens={k: v for w in windows for k, v in w.max_num_batched_tokens.items()},
        kv_cache_dtype={k: v for w in windows for k, v in w.kv_cache_dtype.items()},
        lora_bottleneck=sum(w.lora_bottleneck * w.replicas for w in windows)
        / max(1, sum(w.replicas for w in windows)),
        max_loras={k: v for w in windows for k, v in w.max_loras.items()},
        tpot_buckets=merge_buckets(w.tpot_buckets for w in windows),
        prompt_tokens_buckets=merge_buckets(w.prompt_tokens_buckets for w in windows),
        output_tokens_buckets=merge_buckets(w.output_tokens_buckets for w in windows),
        prompt_tokens_sum=sum(w.prompt_tokens_sum for w in windows),
        output_tokens_sum=sum(w.output_tokens_sum for w in windows),
        requests_finished=sum(w.requests_finished for w in windows),
        slo_requests=sum(w.slo_requests for w in windows),
        slo_requests_met=sum(w.slo_requests_met for w in windows),
        arrivals_per_second=sum(w.arrivals_per_second for w in windows),
        oldest_waiting_seconds=max(w.oldest_waiting_seconds for w in windows),
        steps=observe_steps.merge_steps(w.steps for w in windows),
        kv_num_blocks={k: v for w in windows for k, v in w.kv_num_blocks.items()},
        kv_block_size=_most_common(w.kv_block_size for w in windows if w.kv_block_size),
        padding=_most_common(w.padding for w in windows) or NO_PADDING,
    )


@dataclass
class RoundResult:
    """One scrape round: how many replicas answered, and why the others did not."""

    scraped: int = 0
    failures: dict[str, str] = field(default_factory=dict)  # URL -> reason


class Observer:
    """Samples of the last ``window_seconds`` per service and replica, in memory.

    Losing them (an operator restart) costs one window of observation, no decision: the
    laws' histories live in the InferenceService's status."""

    def __init__(self, window_seconds: float = DEFAULT_WINDOW_SECONDS):
        self.window_seconds = window_seconds
        self._samples: dict[str, dict[str, deque[Sample]]] = {}
        self._listed: dict[str, set[str]] = {}  # the replicas the latest round listed
        self.scrape_failures_total = 0

    def record(self, service: str, scrapes: Iterable[Scrape], now: float) -> RoundResult:
        replicas = self._samples.setdefault(service, {})
        scrapes = list(scrapes)
        self._listed[service] = {s.url for s in scrapes}
        result = RoundResult()
        for scrape in scrapes:
            try:
                if scrape.text is None:
                    raise MalformedMetrics(scrape.error or "no answer")
                sample = parse_metrics(scrape.text, now)
            except MalformedMetrics as e:
                # The parser's error quotes the replica's text: clipped, it goes into status.
                result.failures[scrape.url] = clip(str(e))
                continue
            replicas.setdefault(scrape.url, deque()).append(sample)
            result.scraped += 1
        self.scrape_failures_total += len(result.failures)
        self._prune(replicas, now)
        return result

    def _prune(self, replicas: dict[str, deque[Sample]], now: float) -> None:
        horizon = now - self.window_seconds
        for url in list(replicas):
            samples = replicas[url]
            while samples and samples[0].time < horizon:
                samples.popleft()
            if not samples:
                del replicas[url]  # gone for a whole window: scaled down or replaced

    def replica_windows(
        self, service: str, since: float | None = None, kv_cache_dtype: str | None = None
    ) -> dict[str, Window]:
        """Per-replica windows. ``since`` drops samples from before a time and
        ``kv_cache_dtype`` replicas that run another KV dtype: after a setting change, what
        ran before it, or the old pods of a rollout, say nothing about the new setting."""
        out = {}
        listed = self._listed.get(service, set())
        for url, samples in self._samples.get(service, {}).items():
            if url not in listed:
                continue  # no longer a Ready pod: scaled down, replaced or draining
            kept = [s for s in samples if since is None or s.time >= since]
            if not kept or (
                kv_cache_dtype and kept[-1].kv_cache_dtype not in (None, kv_cache_dtype)
            ):
                continue
            out[url] = replica_window(url, kept)
        return out

    def window(
        self, service: str, since: float | None = None, kv_cache_dtype: str | None = None
    ) -> Window | None:
        return merge_windows(list(self.replica_windows(service, since, kv_cache_dtype).values()))

    def forget(self, service: str) -> None:
        self._samples.pop(service, None)
        self._listed.pop(service, None)
