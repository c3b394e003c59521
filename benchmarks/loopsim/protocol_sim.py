"""One arm of the protocol (a fixed setting or the loop, on one plant, workload and seed),
run in a worker process, and what is kept of it.

``RecordingServiceSim`` is ``ServiceSim`` plus two records the protocol scores: every
applied knob change and the replica-seconds paid for. A knob change is a loop turn after
which the settings in force (what status plans: a rollout, a revert, a KV dtype switch)
or the live settings of any replica that was there before and after (a canary flip, a
live rollout, a revert) differ from what they were before it; scaling alone is none. One
turn counts once however many replicas it touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from batchpilot.operator.crd.spec import InferenceServiceSpec, parse_spec
from benchmarks.loopsim.plant_spec import Plant
from benchmarks.loopsim.replica import ReplicaConfig
from benchmarks.loopsim.result import SimResult
from benchmarks.loopsim.scenarios import Setting
from benchmarks.loopsim.service import ServiceSim
from benchmarks.loopsim.workload_spec import WorkloadSpec, build


class RecordingServiceSim(ServiceSim):
    """ServiceSim that records applied knob changes and replica-seconds."""

    def _reset(self, seed: int) -> None:
        super()._reset(seed)
        self.knob_changes: list[tuple[float, bool]] = []  # (time, capacity-reducing)
        self.pod_seconds = 0.0

    def _knobs(self, status: dict) -> tuple[tuple, dict]:
        s = self.settings(status)
        live = {
            p.engine.url: (p.engine.max_num_seqs, p.engine.max_num_batched_tokens,
                           p.engine.kv_cache_dtype)
            for p in self.pods if not p.draining
        }  # fmt: skip
        return (s.max_num_seqs, s.max_num_batched_tokens, s.kv_cache_dtype), live

    async def _turn(self, status: dict, result: SimResult) -> int:
        before = self._knobs(status)
        failed = await super()._turn(status, result)
        after = self._knobs(status)
        pairs = [(before[0], after[0])]
        pairs += [(before[1][u], after[1][u]) for u in before[1].keys() & after[1].keys()]
        changed = [(a, b) for a, b in pairs if a != b]
        if changed:
            self.knob_changes.append((self.now, any(_reduces(a, b) for a, b in changed)))
        return failed

    def _point(self, status: dict, arrived: int, good: int, failures: int):
        self.pod_seconds += len(self.pods) * self.interval
        return super()._point(status, arrived, good, failures)


def _reduces(before: tuple, after: tuple) -> bool:
    """A lower max_num_seqs or a lower step budget (None: the default, not compared)."""
    (m0, b0, _), (m1, b1, _) = before, after
    return m1 < m0 or (b0 is not None and b1 is not None and b1 < b0)


@dataclass(frozen=True)
class Arm:
    """One simulation: ``setting`` fixed (tuning off) or the loop's start (tuning on)."""

    plant: Plant
    workload: WorkloadSpec
    seed: int
    setting: Setting
    tuning: bool = False
    autoscaling: bool = False
    replicas: int = 1
    max_replicas: int = 6
    load: float = 1.0  # x the workload's rates
    scale: float = 1.0  # x every time in the workload
    start: str = ""  # which start a loop arm is ("under", "best", "over")
    keep_trace: bool = False  # W2: the goodput per interval, for the recovery time

    @property
    def cost(self) -> float:
        """A rough run time, to hand the longest jobs out first."""
        built_duration = (self.workload.duration or self.plant.duration) * self.scale
        per_second = 3.0 if self.plant.calibration.model.step_base_s < 0.02 else 1.0
        return built_duration * per_second * (4.0 if self.tuning else 1.0) * self.replicas


def make_spec(plant: Plant, setting: Setting, arm: Arm) -> InferenceServiceSpec:
    return parse_spec(
        {
            "engine": {
                "maxNumSeqs": setting.max_num_seqs,
                "maxNumBatchedTokens": setting.max_num_batched_tokens,
            },
            "slo": {
                "timeToFirstTokenSeconds": plant.ttft_target,
                "interTokenLatencySeconds": plant.itl_target,
            },
            "tuning": {
                "enabled": arm.tuning,
                "maxNumSeqs": {"min": min(plant.max_num_seqs), "max": max(plant.max_num_seqs)},
                "maxNumBatchedTokens": {"min": min(plant.budgets), "max": max(plant.budgets)},
                "targetInterTokenLatencySeconds": plant.itl_target,
            },
            "autoscaling": {
                "enabled": arm.autoscaling,
                "minReplicas": arm.replicas if arm.autoscaling else 1,
                "maxReplicas": max(arm.max_replicas, arm.replicas),
            },
        }
    )


def arm_sim(arm: Arm, sim_class=None):
    """-> (the arm's built workload, its simulated service, not yet run); sim_class is a
    RecordingServiceSim subclass where a caller records more (loopsim.timeline)."""
    built = build(arm.workload, arm.plant, scale=arm.scale, load=arm.load)
    cal = arm.plant.calibration
    config = ReplicaConfig(
        max_num_seqs=arm.setting.max_num_seqs,
        kv_cache_bytes=built.kv_cache_bytes,
        swap_space_bytes=cal.swap_space_bytes,
        max_num_batched_tokens=cal.default_budget,
        client_patience_s=arm.workload.client_patience(arm.plant),
    )
    sim = (sim_class or RecordingServiceSim)(
        make_spec(arm.plant, arm.setting, arm), config, calibration=cal,
        replicas=arm.replicas, noise=built.noise,
    )  # fmt: skip
    return built, sim


def run_arm(arm: Arm) -> dict:
    """Run one arm; the scores' raw material, small enough to send back from a worker."""
    started, cpu = time.perf_counter(), time.process_time()
    built, sim = arm_sim(arm)
    result = sim.run(built.workload, built.duration, arm.seed)
    half = built.duration / 2
    out = {
        "goodput": result.goodput(),
        "goodput_second_half": result.goodput(since=half),
        "throughput": result.throughput(),
        "duration": built.duration,
        "interval": sim.interval,
        "knob_changes": sim.knob_changes,
        "replica_seconds": sim.pod_seconds,
        "events": len(result.events),
        "scale_downs_on_failed_scrapes": result.scale_downs_on_failed_scrapes,
        "final_setting": _final(result),
        "rate": built.rate * arm.load,
        "wall_seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu,
    }
    if arm.keep_trace:
        out["trace_goodput"] = [p.goodput for p in result.trace]
    if built.noise is not None and hasattr(built.noise, "episodes"):
        out["episodes"] = built.noise.episodes(built.duration)
    return out


def _final(result: SimResult) -> str | None:
    if not result.trace:
        return None
    last = result.trace[-1]
    return f"mns={last.max_num_seqs},budget={last.max_num_batched_tokens}"
