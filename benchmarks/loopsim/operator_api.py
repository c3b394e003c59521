"""What the simulator reads from the operator the way the kopf side reads it: the settings
in force and the pod template, from spec and status (operator/loop/timer.py and
operator/children/plan.py), and the service's SLO."""

from __future__ import annotations

from batchpilot.operator.children.plan import effective_engine, start_engine
from batchpilot.operator.crd.engine import EngineSpec
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.loop.guardrails import TuneLimits
from batchpilot.operator.loop.state import LoopState
from batchpilot.operator.loop.tuner_state import EngineSettings

__all__ = [
    "EngineSettings",
    "TuneLimits",
    "is_fp8",
    "pod_engine",
    "settings_in_force",
    "slo_targets",
]


def is_fp8(dtype: str) -> bool:
    return dtype.startswith("fp8")


def slo_targets(spec: InferenceServiceSpec) -> tuple[float, float]:
    """(TTFT, ITL) targets in seconds."""
    return spec.ttft_target_seconds, spec.itl_target_seconds


def settings_in_force(spec: InferenceServiceSpec, status: dict) -> EngineSettings:
    """loop.timer.settings_in_force for a Deployment that records what status planned
    (the simulated rollout applies a new template at once). The step budget is live only,
    so it counts only where the tuner owns it."""
    planned = effective_engine(spec, LoopState.from_status(status))
    tuned_budget = spec.tuning.enabled and spec.tuning.max_num_batched_tokens is not None
    return EngineSettings(
        planned.max_num_seqs,
        planned.kv_cache_dtype,
        planned.max_num_batched_tokens if tuned_budget else None,
    )


def pod_engine(spec: InferenceServiceSpec, status: dict) -> EngineSpec:
    """The engine a new pod starts with (the Deployment builder's): a tuned step budget
    starts at its range's max and is set live afterwards."""
    return start_engine(spec, effective_engine(spec, LoopState.from_status(status)))
