"""A replica simulator for the closed loop: hours of serving in seconds, no model, no torch.

One simulated replica is a queueing model of ``batchpilot serve``'s engine, step by step:
FCFS admission while ``max_num_seqs``, the token budget and the KV blocks allow; a decode
token per running sequence per step; a new KV block each time a sequence crosses a block
boundary; when none is free, the newest running sequence is preempted (swapped to CPU while
swap space lasts, else dropped for recompute), as server/scheduler.py does.

Calibration (``EngineModel``'s defaults), from the engine benchmark on the bundled
SmolLM2-135M-Instruct, bfloat16, 2 CPU cores (benchmarks/README.md, results/*.json):
- step time = 40.8 ms + 2.55 ms per sequence + 2.3 µs per context token + 0.8 ms per
  prefill token. The first two are a least-squares fit of the online sweep's TPOT P50 at 2,
  8 and 32 concurrent streams (41.2, 70.8, 132.2 ms; prompts 118 tokens on average); the
  context term is the decode profile's attention share (29% of 116 ms at 32 x 458 context
  tokens); the prefill term lies between the sweep's TTFT at 2 streams ((108 - 41) ms /
  118 tokens) and the interference run's 1,600-token prompt (1.2 ms a token).
- KV block = 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 16 tokens x the element size:
  368,640 bytes in bfloat16, half that in fp8 (``kv_cache_dtype``).
- a swap moves a sequence's blocks at 8 GB/s, the profile's bandwidth for weights that miss
  the cache.

The service driver routes arrivals round-robin over Ready replicas, starts replicas after a
start-up delay, drains the ones scaled away, rolls every replica on a KV dtype change
(maxSurge, maxUnavailable 0), and every ``interval`` runs the REAL loop
(``loop.ClosedLoop``: observe → decide_replicas / decide_tuning → apply) on the replicas'
metrics, rendered as Prometheus text by prometheus_client, with the status round-tripped
the way the kopf side does it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from batchpilot import names
from batchpilot.operator.crd import InferenceServiceSpec
from batchpilot.operator.loop import ClosedLoop
from batchpilot.operator.observe import Observer, Scrape
from batchpilot.operator.resources import LoopState, effective_engine
from batchpilot.operator.tune import EngineSettings, TuneLimits, is_fp8

# The server's buckets (server/api/metrics.py; a unit test keeps them equal), so P99s
# quantize the way real ones do.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
MODEL_NAME = names.DEFAULT_SERVED_MODEL_NAME


@dataclass(frozen=True)
class EngineModel:
    step_base_s: float = 0.0408
    step_per_seq_s: float = 0.00255
    step_per_context_token_s: float = 2.3e-6
    prefill_per_token_s: float = 0.0008
    block_size: int = 16
    bytes_per_block_16bit: int = 368_640
    swap_bytes_per_s: float = 8e9

    def block_bytes(self, kv_cache_dtype: str) -> int:
        return self.bytes_per_block_16bit // (2 if is_fp8(kv_cache_dtype) else 1)


@dataclass(frozen=True)
class ReplicaConfig:
    max_num_seqs: int = 32
    kv_cache_dtype: str = "auto"
    kv_cache_bytes: int = 1 << 30
    swap_space_bytes: int = 4 << 30
    max_num_batched_tokens: int = 2048


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Request:
    arrival: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Poisson arrivals at ``rate(t)`` per second (thinned against ``peak``); with
    ``burstiness`` < 1, gamma gaps of that shape instead (vllm bench serve's knob), so the
    same mean rate comes in clumps."""

    rate: Callable[[float], float]
    peak: float
    prompt_lens: tuple[int, ...] = (32, 64, 128, 256)
    output_lens: tuple[int, ...] = (32, 64, 128, 256)
    burstiness: float = 1.0

    def requests(self, duration: float, seed: int = 0) -> Iterator[Request]:
        rng = random.Random(seed)
        t = 0.0
        while True:
            t += rng.gammavariate(self.burstiness, 1.0 / (self.burstiness * self.peak))
            if t >= duration:
                return
            if rng.random() * self.peak <= self.rate(t):
                yield Request(t, rng.choice(self.prompt_lens), rng.choice(self.output_lens))


def steady(rate: float, **kw) -> Workload:
    return Workload(lambda t: rate, rate, **kw)


def step_load(before: float, after: float, at: float, **kw) -> Workload:
    return Workload(lambda t: before if t < at else after, max(before, after), **kw)


def diurnal(mean: float, amplitude: float, period: float, **kw) -> Workload:
    """A day compressed into ``period`` seconds: mean ± amplitude, lowest at t = 0."""
    return Workload(
        lambda t: mean - amplitude * math.cos(2 * math.pi * t / period), mean + amplitude, **kw
    )


def bursty(rate: float, burstiness: float = 0.25, **kw) -> Workload:
    return Workload(lambda t: rate, rate, burstiness=burstiness, **kw)


# --------------------------------------------------------------------------- one replica


@dataclass(eq=False)
class _Seq:
    req: Request
    prompt: int  # tokens to prefill on (re)admission: the prompt, plus output if recomputed
    generated: int = 0
    blocks: int = 0
    first_token: bool = False

    def context(self) -> int:
        return self.req.prompt_len + self.generated


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


class ReplicaSim:
    """One server's engine in simulated time; ``advance_to`` runs whole steps."""

    def __init__(self, url: str, config: ReplicaConfig, model: EngineModel, start: float):
        self.url = url
        self.model = model
        self.max_num_seqs = config.max_num_seqs
        self.kv_cache_dtype = config.kv_cache_dtype
        self.budget = max(config.max_num_batched_tokens, config.max_num_seqs)
        block_bytes = model.block_bytes(config.kv_cache_dtype)
        self.num_blocks = config.kv_cache_bytes // block_bytes
        self.free_blocks = self.num_blocks
        self.cpu_free = config.swap_space_bytes // block_bytes
        self.time = start
        self.waiting: deque[_Seq] = deque()
        self.swapped: deque[_Seq] = deque()
        self.running: list[_Seq] = []  # admission order: the newest is preempted first
        self.context_tokens = 0  # summed over running sequences
        self.counters = dict.fromkeys(("preemptions", "swaps_out", "swaps_in", "gen", "prompt"), 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.finished = 0

    # -- the engine step

    def submit(self, req: Request) -> None:
        self.waiting.append(_Seq(req, req.prompt_len))

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    def advance_to(self, t: float) -> None:
        while self.time < t and self.has_work():
            self.time += self.step()
        self.time = max(self.time, t)

    def step(self) -> float:
        seconds = self._grow_blocks()
        seconds += self._swap_in()
        prefill = self._admit()
        decoding = len(self.running)
        seconds += (
            self.model.step_base_s
            + self.model.step_per_seq_s * decoding
            + self.model.step_per_context_token_s * self.context_tokens
            + self.model.prefill_per_token_s * prefill
        )
        self._emit_tokens(seconds)
        return seconds

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.model.block_size)

    def _grow_blocks(self) -> float:
        """Each running sequence writes one more token; some need a new block. Preempt the
        newest until they fit. Returns the seconds spent swapping."""
        seconds = 0.0
        while True:
            needy = [s for s in self.running if s.context() - 1 >= s.blocks * self.model.block_size]
            if len(needy) <= self.free_blocks:
                break
            seconds += self._preempt(self.running[-1])
        for s in needy:
            s.blocks += 1
        self.free_blocks -= len(needy)
        return seconds

    def _preempt(self, seq: _Seq) -> float:
        self.running.pop()
        self.context_tokens -= seq.context()
        self.free_blocks += seq.blocks
        self.counters["preemptions"] += 1
        if seq.blocks <= self.cpu_free:
            self.cpu_free -= seq.blocks
            self.counters["swaps_out"] += 1
            self.swapped.append(seq)
            return self._swap_seconds(seq.blocks)
        seq.prompt, seq.blocks = seq.context(), 0  # recompute: prefill everything again
        self.waiting.appendleft(seq)
        return 0.0

    def _swap_seconds(self, blocks: int) -> float:
        return blocks * self.model.block_bytes(self.kv_cache_dtype) / self.model.swap_bytes_per_s

    def _swap_in(self) -> float:
        seconds = 0.0
        while (
            self.swapped
            and len(self.running) < self.max_num_seqs
            and self.swapped[0].blocks + 1 <= self.free_blocks
        ):
            seq = self.swapped.popleft()
            self.cpu_free += seq.blocks
            self.free_blocks -= seq.blocks
            self.counters["swaps_in"] += 1
            self._run(seq)
            seconds += self._swap_seconds(seq.blocks)
        return seconds

    def _admit(self) -> int:
        tokens = len(self.running)
        prefill = 0
        while self.waiting and not self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = self._blocks_for(seq.prompt)
            if need > self.free_blocks or tokens + seq.prompt > self.budget:
                break
            self.waiting.popleft()
            self.free_blocks -= need
            seq.blocks = need
            tokens += seq.prompt
            prefill += seq.prompt
            self.counters["prompt"] += seq.prompt
            self._run(seq)
        return prefill

    def _run(self, seq: _Seq) -> None:
        self.running.append(seq)
        self.context_tokens += seq.context()

    def _emit_tokens(self, seconds: float) -> None:
        decodes = 0
        still = []
        for seq in self.running:
            if seq.first_token:
                decodes += 1
            else:
                seq.first_token = True
                self.ttft.observe(self.time + seconds - seq.req.arrival)
            seq.generated += 1
            if seq.generated >= seq.req.output_len:
                self.free_blocks += seq.blocks
                self.context_tokens -= seq.context() - 1
                self.finished += 1
            else:
                still.append(seq)
        self.context_tokens += len(still)
        self.counters["gen"] += len(self.running)
        self.running = still
        if decodes:
            self.itl.observe(seconds, decodes)

    # -- what /metrics shows

    def metrics_text(self) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry).decode()


class _Collector:
    def __init__(self, replica: ReplicaSim):
        self.r = replica

    def collect(self):
        r, label = self.r, [names.METRIC_LABEL]
        gauges = (
            (names.NUM_REQUESTS_RUNNING, len(r.running)),
            (names.NUM_REQUESTS_WAITING, len(r.waiting)),
            (names.NUM_REQUESTS_SWAPPED, len(r.swapped)),
            (names.KV_CACHE_USAGE, 1 - r.free_blocks / r.num_blocks),
            (names.MAX_NUM_SEQS_METRIC, r.max_num_seqs),
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


# --------------------------------------------------------------------------- the service


@dataclass(eq=False)
class _Pod:
    engine: ReplicaSim
    ready_at: float
    draining: bool = False

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and not self.draining


@dataclass(frozen=True)
class TracePoint:
    time: float
    offered_per_second: float
    waiting: int
    running: int
    swapped: int
    ready_replicas: int
    desired_replicas: int
    max_num_seqs: int
    kv_cache_dtype: str
    preemptions: int  # cumulative, over every replica that ever ran
    itl_p99: float | None


@dataclass
class SimResult:
    trace: list[TracePoint]
    events: list[tuple[float, str, str]]  # (time, reason, message) as the operator posts them
    status: dict
    arrived: int = 0
    finished: int = 0

    def changes(self, reason_prefix: str) -> list[tuple[float, str, str]]:
        return [e for e in self.events if e[1].startswith(reason_prefix)]


class _SimSource:
    """The MetricsSource of the simulated Ready pods."""

    def __init__(self, service: ServiceSim):
        self.service = service

    async def scrape(self, namespace: str, name: str) -> list[Scrape]:
        now = self.service.now
        return [Scrape(p.engine.url, text=p.engine.metrics_text()) for p in self.service.ready(now)]


class _SimAdmin:
    """The admin client's set_max_num_seqs, on the simulated replicas."""

    def __init__(self, service: ServiceSim):
        self.service = service

    async def set_max_num_seqs(self, urls, token: str, value: int) -> dict[str, str | None]:
        by_url = {p.engine.url: p.engine for p in self.service.pods}
        for url in urls:
            by_url[url].max_num_seqs = value
        return dict.fromkeys(urls)


class ServiceSim:
    """An InferenceService's replicas under a workload, driven by the real closed loop."""

    def __init__(
        self,
        spec: InferenceServiceSpec,
        config: ReplicaConfig,
        model: EngineModel = EngineModel(),
        replicas: int = 1,
        startup_seconds: float = 60.0,
        interval: float = 15.0,
        window_seconds: float = 60.0,
        limits: TuneLimits = TuneLimits(),
    ):
        self.spec = spec
        self.config = config
        self.model = model
        self.startup_seconds = startup_seconds
        self.interval = interval
        self.now = 0.0
        self.pods: list[_Pod] = []
        self.retired_preemptions = 0
        self._names = itertools.count()
        self._next = 0  # round-robin position
        self.loop = ClosedLoop(
            _SimSource(self), _SimAdmin(self), clock=lambda: self.now,
            observer=Observer(window_seconds), limits=limits,
        )  # fmt: skip
        for _ in range(replicas):
            self._add_pod(self._template(self.settings({})), ready_at=0.0)

    def ready(self, now: float) -> list[_Pod]:
        return [p for p in self.pods if p.ready(now)]

    def _add_pod(self, config: ReplicaConfig, ready_at: float) -> _Pod:
        url = f"sim://replica-{next(self._names)}"
        pod = _Pod(ReplicaSim(url, config, self.model, start=ready_at), ready_at)
        self.pods.append(pod)
        return pod

    # -- time

    def _advance(self, t: float) -> None:
        for pod in self.pods:
            if t >= pod.ready_at:
                pod.engine.advance_to(t)
        self._retire(t)
        self.now = t

    def _retire(self, t: float) -> None:
        for pod in [p for p in self.pods if p.draining and not p.engine.has_work()]:
            self.pods.remove(pod)
            self.retired_preemptions += pod.engine.counters["preemptions"]

    def _route(self, req: Request) -> None:
        ready = self.ready(req.arrival)
        if not ready:  # nothing Ready yet: the request waits on the oldest pod starting
            ready = [p for p in self.pods if not p.draining][:1]
        pod = ready[self._next % len(ready)]
        self._next += 1
        pod.engine.submit(req)

    # -- the operator's side: status, replicas and the pod template

    def settings(self, status: dict) -> EngineSettings:
        engine = effective_engine(self.spec, LoopState.from_status(status))
        return EngineSettings(engine.max_num_seqs, engine.kv_cache_dtype)

    def _template(self, settings: EngineSettings) -> ReplicaConfig:
        return ReplicaConfig(
            max_num_seqs=settings.max_num_seqs,
            kv_cache_dtype=settings.kv_cache_dtype,
            kv_cache_bytes=self.config.kv_cache_bytes,
            swap_space_bytes=self.config.swap_space_bytes,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )

    def _scale_to(self, desired: int, settings: EngineSettings) -> None:
        live = [p for p in self.pods if not p.draining]
        for _ in range(desired - len(live)):
            self._add_pod(self._template(settings), self.now + self.startup_seconds)
        # Scale down the newest first (starting pods serve nothing yet).
        for pod in sorted(live, key=lambda p: -p.ready_at)[: max(0, len(live) - desired)]:
            self._drain(pod)

    def _drain(self, pod: _Pod) -> None:
        pod.draining = True
        for seq in list(pod.engine.waiting):  # the endpoint is gone: retries land elsewhere
            if seq.generated == 0:
                pod.engine.waiting.remove(seq)
                self._route(seq.req)

    def _roll(self, settings: EngineSettings) -> None:
        """A new pod template: surge a replacement per pod, drain the old one once it is
        Ready (maxUnavailable 0)."""
        old = [p for p in self.pods if not p.draining]
        for _ in old:
            self._add_pod(self._template(settings), self.now + self.startup_seconds)
        self._rolling = old

    def _finish_roll(self) -> None:
        fresh = [p for p in self.pods if p not in self._rolling and p.ready(self.now)]
        while self._rolling and fresh:
            self._drain(self._rolling.pop())
            fresh.pop()

    # -- the run

    def run(self, workload: Workload, duration: float, seed: int = 0) -> SimResult:
        return asyncio.run(self._run(workload, duration, seed))

    async def _run(self, workload: Workload, duration: float, seed: int) -> SimResult:
        status: dict = {}
        result = SimResult([], [], status)
        arrivals = workload.requests(duration, seed)
        pending = next(arrivals, None)
        self._rolling: list[_Pod] = []
        tick = self.interval
        while tick <= duration:
            arrived = 0
            while pending is not None and pending.arrival < tick:
                self._advance(pending.arrival)
                self._route(pending)
                arrived += 1
                pending = next(arrivals, None)
            self._advance(tick)
            self._finish_roll()
            result.arrived += arrived
            await self._turn(status, result)
            result.trace.append(self._point(status, arrived / self.interval))
            tick += self.interval
        result.finished = sum(p.engine.finished for p in self.pods)
        return result

    async def _turn(self, status: dict, result: SimResult) -> None:
        settings = self.settings(status)
        live = sum(not p.draining for p in self.pods) - len(self._rolling)
        outcome = await self.loop.run_once(
            "sim", "service", self.spec, status, live, settings, admin_token="sim"
        )
        status.update(outcome.status_patch)  # kopf merges the patch into status
        result.events += [(self.now, reason, message) for reason, message in outcome.events]
        new = self.settings(status)
        if new.kv_cache_dtype != settings.kv_cache_dtype:
            self._roll(new)
        if outcome.desired_replicas is not None:
            self._scale_to(outcome.desired_replicas + len(self._rolling), new)

    def _point(self, status: dict, offered: float) -> TracePoint:
        engines = [p.engine for p in self.pods]
        settings = self.settings(status)
        window = self.loop.observer.window("sim/service")
        return TracePoint(
            time=self.now,
            offered_per_second=offered,
            waiting=sum(len(e.waiting) for e in engines),
            running=sum(len(e.running) for e in engines),
            swapped=sum(len(e.swapped) for e in engines),
            ready_replicas=len(self.ready(self.now)),
            desired_replicas=(status.get("autoscaling") or {}).get("desiredReplicas", len(engines)),
            max_num_seqs=settings.max_num_seqs,
            kv_cache_dtype=settings.kv_cache_dtype,
            preemptions=self.retired_preemptions + sum(e.counters["preemptions"] for e in engines),
            itl_p99=window.itl_p99 if window else None,
        )
