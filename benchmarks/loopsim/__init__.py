"""The closed loop in simulation: the operator's real loop (``loop.turn.ClosedLoop``) against
simulated replicas that respond to its decisions. Used by tests and benchmarks only, so
it lives outside the operator image's package.

- calibration.py: the step-time and KV-cache figures (this CPU; an H100 with Llama-3-8B)
- replica.py: one engine, step by step (chunked prefill, KV blocks, preemption)
- metrics.py: its /metrics, as the server renders them
- workloads.py: arrival processes
- faults.py: dropped scrapes, a blind replica, a replica that rejects live changes
- service.py: replicas, routing, rollouts and the loop's turns
- result.py: per-request goodput and the loop's decisions, read from its Events
- scenarios.py, evaluate.py, report.py: the evaluation (``python -m benchmarks.loopsim.evaluate``)
"""

from benchmarks.loopsim.calibration import CPU, H100_LLAMA3_8B, Calibration, EngineModel
from benchmarks.loopsim.faults import Faults
from benchmarks.loopsim.metrics import ITL_BUCKETS, TTFT_BUCKETS
from benchmarks.loopsim.replica import ReplicaConfig, ReplicaSim, StepNoise
from benchmarks.loopsim.result import SimResult, TracePoint
from benchmarks.loopsim.service import ServiceSim
from benchmarks.loopsim.workloads import (
    Request,
    Workload,
    bursty,
    diurnal,
    heavy_prefill,
    steady,
    step_load,
)

__all__ = [
    "CPU",
    "H100_LLAMA3_8B",
    "ITL_BUCKETS",
    "TTFT_BUCKETS",
    "Calibration",
    "EngineModel",
    "Faults",
    "ReplicaConfig",
    "ReplicaSim",
    "Request",
    "ServiceSim",
    "SimResult",
    "StepNoise",
    "TracePoint",
    "Workload",
    "bursty",
    "diurnal",
    "heavy_prefill",
    "steady",
    "step_load",
]
