"""The evaluation's cases: per calibration, an SLO, a starting setting, the grid a fixed
setting is swept over, and six workloads scaled to what one replica serves.

Rates are set so that the starting setting is short of capacity and a setting inside the
tuner's bounds is not: the loop has something to find, and a fixed sweep knows where."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchpilot.operator.crd.spec import InferenceServiceSpec, parse_spec
from benchmarks.loopsim.calibration import CPU, H100_LLAMA3_8B, Calibration
from benchmarks.loopsim.replica import StepNoise
from benchmarks.loopsim.workloads import Workload, bursty, diurnal, heavy_prefill, steady, step_load

# A noisy neighbour: one step in twenty takes four times as long, whatever its batch.
NOISY_NEIGHBOUR = StepNoise(probability=0.05, factor=4.0)
CONVERGED_SECONDS = 1800.0  # the steady run's settling time before its quiet 2 h
QUIET_SECONDS = 7200.0


@dataclass(frozen=True)
class Setting:
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def label(self) -> str:
        return f"mns={self.max_num_seqs},budget={self.max_num_batched_tokens}"


@dataclass(frozen=True)
class Case:
    """One calibration's evaluation."""

    calibration: Calibration
    ttft_target: float
    itl_target: float
    start: Setting
    max_num_seqs: tuple[int, ...]  # swept, and the tuner's bounds
    budgets: tuple[int, ...]
    rate: float  # chat requests/s: the start setting queues, the best does not
    heavy_prefill_rate: float
    long_prompts: tuple[int, ...]  # heavy-prefill's, tokens
    duration: float

    def grid(self) -> list[Setting]:
        return [Setting(m, b) for m in self.max_num_seqs for b in self.budgets]

    def spec(self, setting: Setting, tuning: bool, autoscaling: bool) -> InferenceServiceSpec:
        return parse_spec(
            {
                "engine": {
                    "maxNumSeqs": setting.max_num_seqs,
                    "maxNumBatchedTokens": setting.max_num_batched_tokens,
                },
                "slo": {
                    "timeToFirstTokenSeconds": self.ttft_target,
                    "interTokenLatencySeconds": self.itl_target,
                },
                "tuning": {
                    "enabled": tuning,
                    "maxNumSeqs": {"min": min(self.max_num_seqs), "max": max(self.max_num_seqs)},
                    "maxNumBatchedTokens": {"min": min(self.budgets), "max": max(self.budgets)},
                    "targetInterTokenLatencySeconds": self.itl_target,
                },
                "autoscaling": {"enabled": autoscaling, "minReplicas": 1, "maxReplicas": 6},
            }
        )


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: Callable[[Case, float], Workload]  # (case, duration) -> workload
    noise: StepNoise | None = None
    long: bool = False  # steady: also judged on its last 2 h, after convergence


SCENARIOS = (
    Scenario("steady", lambda c, d: steady(c.rate), long=True),
    Scenario("step", lambda c, d: step_load(0.5 * c.rate, 1.3 * c.rate, at=d / 3)),
    Scenario("diurnal", lambda c, d: diurnal(c.rate, 0.5 * c.rate, period=d)),
    Scenario("bursty", lambda c, d: bursty(c.rate, burstiness=0.25)),
    Scenario("heavy-prefill", lambda c, d: heavy_prefill(c.heavy_prefill_rate, c.long_prompts)),
    Scenario("noisy-neighbour", lambda c, d: steady(c.rate), noise=NOISY_NEIGHBOUR),
)

CASES = {
    # This CPU: 8 slots serve ~0.85 requests/s of the chat mix (~100 tokens/s); 16 and up
    # serve the 0.9 offered within the 150 ms ITL target.
    "cpu": Case(
        CPU,
        ttft_target=2.0,
        itl_target=0.15,
        start=Setting(8, 512),
        max_num_seqs=(4, 8, 16, 32, 64),
        budgets=(128, 512),
        rate=0.9,
        heavy_prefill_rate=1.0,
        long_prompts=(384, 512, 768),
        duration=3600.0,
    ),
    # An H100 with Llama-3-8B: 32 slots serve ~3,500 tokens/s; the chat load wants ~3,600.
    "h100-llama3-8b": Case(
        H100_LLAMA3_8B,
        ttft_target=1.0,
        itl_target=0.03,
        start=Setting(32, 2048),
        max_num_seqs=(16, 32, 64, 128, 256),
        budgets=(512, 2048),
        rate=30.0,
        heavy_prefill_rate=12.0,
        long_prompts=(1024, 1536, 2048),
        # 20 simulated minutes: a GPU's ~100 steps/s make it the evaluation's costliest.
        duration=1200.0,
    ),
}
