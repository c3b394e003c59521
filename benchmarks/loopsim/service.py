"""An InferenceService in simulation: replicas under a workload, driven by the REAL loop.

The driver routes arrivals round-robin over Ready replicas, starts replicas after a
start-up delay, drains the ones scaled away, rolls every replica on a KV dtype change
either way (maxSurge, maxUnavailable 0), and every ``interval`` runs
``loop.turn.ClosedLoop.run_once`` on the replicas' metrics, rendered as Prometheus text, with
the status round-tripped the way the kopf side does it: merged into status, read back
through ``loop.state.LoopState.from_status`` and ``effective_engine`` into the pod
template. Live changes reach running replicas only through the admin fake.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, replace

from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.loop.observe import Observer
from batchpilot.operator.loop.scrape import Scrape
from batchpilot.operator.loop.state import LoopState
from batchpilot.operator.loop.turn import ClosedLoop
from benchmarks.loopsim.calibration import CPU, Calibration
from benchmarks.loopsim.faults import NONE, FaultInjector, Faults
from benchmarks.loopsim.operator_api import (
    EngineSettings,
    TuneLimits,
    pod_engine,
    settings_in_force,
    slo_targets,
)
from benchmarks.loopsim.replica import ReplicaConfig, ReplicaSim, StepNoise
from benchmarks.loopsim.result import SimResult, TracePoint
from benchmarks.loopsim.workloads import Request, Workload


@dataclass(eq=False)
class _Pod:
    engine: ReplicaSim
    ready_at: float
    draining: bool = False
    reported: int = 0  # finished requests already moved into the result

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and not self.draining


class _SimSource:
    """The MetricsSource of the simulated Ready pods; a failed scrape carries its error."""

    def __init__(self, service: ServiceSim):
        self.service = service

    async def scrape(self, namespace: str, name: str) -> list[Scrape]:
        out = []
        for pod in self.service.ready(self.service.now):
            url = pod.engine.url  # a simulated pod's admin API answers on its one URL
            error = self.service.faults.scrape_error(url)
            if error:
                out.append(Scrape(url, error=error, admin_url=url))
            else:
                out.append(Scrape(url, text=pod.engine.metrics_text(), admin_url=url))
        return out


class _SimAdmin:
    """The admin client's live changes, on the simulated replicas."""

    def __init__(self, service: ServiceSim):
        self.service = service

    async def set_live(self, urls, token: str, changes: dict) -> dict[str, str | None]:
        engines = {p.engine.url: p.engine for p in self.service.pods}
        out: dict[str, str | None] = {}
        for url in urls:
            out[url] = self.service.faults.apply_error(url)
            if out[url] is None and url in engines:
                for knob, value in changes.items():
                    setattr(engines[url], knob, value)  # max_num_seqs, max_num_batched_tokens
            elif url not in engines:
                out[url] = "gone"
        return out


class ServiceSim:
    """An InferenceService's replicas under a workload, driven by the real closed loop."""

    def __init__(
        self,
        spec: InferenceServiceSpec,
        config: ReplicaConfig | None = None,
        calibration: Calibration = CPU,
        replicas: int = 1,
        startup_seconds: float = 60.0,
        interval: float = 15.0,
        window_seconds: float = 60.0,
        limits: TuneLimits = TuneLimits(),
        noise: StepNoise | None = None,
        faults: Faults = NONE,
    ):
        self.spec = spec
        self.calibration = calibration
        self.config = config or ReplicaConfig(
            kv_cache_bytes=calibration.kv_cache_bytes,
            swap_space_bytes=calibration.swap_space_bytes,
            max_num_batched_tokens=calibration.default_budget,
        )
        self.startup_seconds = startup_seconds
        self.interval = interval
        self.noise = noise
        self.fault_spec = faults
        self.replicas = replicas
        self.now = 0.0
        self.loop = ClosedLoop(
            _SimSource(self), _SimAdmin(self), clock=lambda: self.now,
            observer=Observer(window_seconds), limits=limits,
        )  # fmt: skip

    def ready(self, now: float) -> list[_Pod]:
        return [p for p in self.pods if p.ready(now)]

    def _add_pod(self, config: ReplicaConfig, ready_at: float) -> _Pod:
        n = next(self._names)
        if self.spec.tuning.enabled:  # as the operator passes spec.slo to tuned pods
            config = replace(config, slo=slo_targets(self.spec))
        engine = ReplicaSim(
            f"sim://replica-{n}", config, self.calibration.model, start=ready_at,
            noise=self.noise, seed=hash((self._seed, n)),
        )  # fmt: skip
        pod = _Pod(engine, ready_at)
        self.pods.append(pod)
        return pod

    # -- time

    def _advance(self, t: float) -> None:
        for pod in self.pods:
            if t >= pod.ready_at:
                pod.engine.advance_to(t)
        self._retire()
        self.now = t

    def _retire(self) -> None:
        for pod in [p for p in self.pods if p.draining and not p.engine.has_work()]:
            self._collect(pod)
            self.pods.remove(pod)
            self.retired_preemptions += pod.engine.counters["preemptions"]

    def _collect(self, pod: _Pod) -> None:
        self._result.requests += pod.engine.done[pod.reported :]
        pod.reported = len(pod.engine.done)

    def _route(self, req: Request) -> None:
        ready = self.ready(req.arrival)
        if not ready:  # nothing Ready yet: the request waits on the oldest pod starting
            ready = [p for p in self.pods if not p.draining][:1]
        pod = ready[self._next % len(ready)]
        self._next += 1
        pod.engine.submit(req)

    # -- the operator's side: status, replicas and the pod template

    def settings(self, status: dict) -> EngineSettings:
        return settings_in_force(self.spec, status)

    def _template(self, status: dict) -> ReplicaConfig:
        engine = pod_engine(self.spec, status)
        return ReplicaConfig(
            max_num_seqs=engine.max_num_seqs,
            kv_cache_dtype=engine.kv_cache_dtype,
            kv_cache_bytes=self.config.kv_cache_bytes,
            swap_space_bytes=self.config.swap_space_bytes,
            max_num_batched_tokens=engine.max_num_batched_tokens
            or self.config.max_num_batched_tokens,
            client_patience_s=self.config.client_patience_s,
        )

    def _scale_to(self, desired: int, status: dict) -> None:
        live = [p for p in self.pods if not p.draining]
        for _ in range(desired - len(live)):
            self._add_pod(self._template(status), self.now + self.startup_seconds)
        # Scale down the newest first (starting pods serve nothing yet).
        for pod in sorted(live, key=lambda p: -p.ready_at)[: max(0, len(live) - desired)]:
            self._drain(pod)

    def _drain(self, pod: _Pod) -> None:
        pod.draining = True
        for seq in list(pod.engine.waiting):  # the endpoint is gone: retries land elsewhere
            if seq.generated == 0:
                pod.engine.waiting.remove(seq)
                self._route(seq.req)

    def _roll(self, status: dict) -> None:
        """A new pod template: surge a replacement per pod, drain the old one once it is
        Ready (maxUnavailable 0)."""
        old = [p for p in self.pods if not p.draining]
        for _ in old:
            self._add_pod(self._template(status), self.now + self.startup_seconds)
        self._rolling = old

    def _finish_roll(self) -> None:
        fresh = [p for p in self.pods if p not in self._rolling and p.ready(self.now)]
        while self._rolling and fresh:
            self._drain(self._rolling.pop())
            fresh.pop()

    # -- the run

    def run(self, workload: Workload, duration: float, seed: int = 0) -> SimResult:
        return asyncio.run(self._run(workload, duration, seed))

    def _reset(self, seed: int) -> None:
        self._seed = seed
        self.faults = FaultInjector(self.fault_spec, seed)
        self.pods: list[_Pod] = []
        self._rolling: list[_Pod] = []
        self.retired_preemptions = 0
        self._names = itertools.count()
        self._next = 0  # round-robin position
        self.now = 0.0
        for _ in range(self.replicas):
            self._add_pod(self._template({}), ready_at=0.0)

    async def _run(self, workload: Workload, duration: float, seed: int) -> SimResult:
        self._reset(seed)
        status: dict = {}
        result = self._result = SimResult([], [], status, duration, slo_targets(self.spec))
        arrivals = workload.requests(duration, seed)
        pending = next(arrivals, None)
        # With both loops off nothing reads the metrics: skip the turns (the fixed-setting
        # sweeps are most of an evaluation's runs).
        looping = self.spec.autoscaling.enabled or self.spec.tuning.enabled
        tick = self.interval
        while tick <= duration:
            arrived, before = 0, len(result.requests)
            while pending is not None and pending.arrival < tick:
                self._advance(pending.arrival)
                self._route(pending)
                arrived += 1
                pending = next(arrivals, None)
            self._advance(tick)
            self._finish_roll()
            for pod in self.pods:
                self._collect(pod)
            result.arrived += arrived
            failures = await self._turn(status, result) if looping else 0
            good = sum(r.output_len for r in result.requests[before:] if result.meets_slo(r))
            result.trace.append(self._point(status, arrived, good, failures))
            tick += self.interval
        return result

    async def _turn(self, status: dict, result: SimResult) -> int:
        settings = self.settings(status)
        live = sum(not p.draining for p in self.pods) - len(self._rolling)
        outcome = await self.loop.run_once(
            "sim", "service", self.spec, status, live, settings, admin_token="sim"
        )
        # The API server refuses a patch JSON cannot carry (an infinity): so does the sim.
        json.dumps(outcome.status_patch, allow_nan=False)
        status.update(outcome.status_patch)  # kopf merges the patch into status
        events = [(self.now, reason, message) for reason, message in outcome.events]
        result.events += events
        failed = len(outcome.scrape_failures)
        if failed and any(reason == "ScaledDown" for _, reason, _ in events):
            result.scale_downs_on_failed_scrapes += 1
        if self.settings(status).kv_cache_dtype != settings.kv_cache_dtype:
            self._roll(status)
        if outcome.desired_replicas is not None:
            self._scale_to(outcome.desired_replicas + len(self._rolling), status)
        return failed

    def _point(self, status: dict, arrived: int, good: int, failures: int) -> TracePoint:
        engines = [p.engine for p in self.pods]
        settings = self.settings(status)
        window = self.loop.observer.window("sim/service")
        desired = LoopState.from_status(status).replicas
        return TracePoint(
            time=self.now,
            offered_per_second=arrived / self.interval,
            waiting=sum(len(e.waiting) for e in engines),
            running=sum(e.num_running for e in engines),
            swapped=sum(len(e.swapped) for e in engines),
            ready_replicas=len(self.ready(self.now)),
            desired_replicas=len(engines) if desired is None else desired,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            kv_cache_dtype=settings.kv_cache_dtype,
            preemptions=self.retired_preemptions + sum(e.counters["preemptions"] for e in engines),
            itl_p99=window.itl_p99 if window else None,
            goodput=good / self.interval,
            scrape_failures=failures,
        )
