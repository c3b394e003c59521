"""The keep-or-revert judge of a trial change: every engine change is judged on the
objective, goodput within the latency targets, by comparing the window after it with a
baseline; kept only if it helped.

Goodput is estimated from the servers' vLLM histograms, so it works against any
vLLM-compatible server: generation tokens/s x the share of inter-token gaps within the ITL
target x the share of first tokens within the TTFT target. (Per-request goodput would need
per-request latencies, which /metrics does not carry; the shares are per observation.)

Equal offered load: when both windows had a queue, the replicas ran as fast as they could
and goodput compares directly; otherwise throughput is whatever arrived, so the share of
tokens within the SLO (attainment) is compared instead, which does not move with the
arrival rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot.operator.loop.observe import Buckets, Window, histogram_quantile
from batchpilot.operator.loop.tuner_state import Score


@dataclass(frozen=True)
class Targets:
    ttft_seconds: float
    itl_seconds: float


@dataclass(frozen=True)
class JudgeLimits:
    min_gain: float = 0.03  # a change must add this share of goodput to be kept
    tolerance: float = 0.05  # a change that restores a latency target may cost this share
    saturated_queue: float = 0.5  # mean waiting per replica that counts as a queue
    min_attainment: float = 0.05  # under this share within the SLO, goodput says nothing


def share_within(buckets: Buckets, target: float) -> float:
    """The share of a histogram's observations at or under ``target``, interpolated
    linearly inside the bucket that holds it (as histogram_quantile does). 1 when empty:
    nothing observed missed."""
    if not buckets or buckets[-1][1] <= 0:
        return 1.0
    total = buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if target <= le:
            if le == float("inf") or le == lower:
                return below / total
            return (below + (count - below) * (target - lower) / (le - lower)) / total
        lower, below = le, count
    return 1.0


def score(window: Window, targets: Targets) -> Score:
    """The window's objective, per replica."""
    throughput = window.per_replica(window.generation_tokens_per_second)
    within = share_within(window.itl_buckets, targets.itl_seconds) * share_within(
        window.ttft_buckets, targets.ttft_seconds
    )
    return Score(
        goodput=throughput * within,
        throughput=throughput,
        waiting=window.per_replica(window.waiting),
        itl_p99=histogram_quantile(0.99, window.itl_buckets),
        ttft_p99=histogram_quantile(0.99, window.ttft_buckets),
        samples=int(window.itl_buckets[-1][1]) if window.itl_buckets else 0,
        seconds=window.span_seconds,
        running=window.per_replica(window.running),
    )


def misses_slo(s: Score, targets: Targets) -> bool:
    return (s.itl_p99 is not None and s.itl_p99 > targets.itl_seconds) or (
        s.ttft_p99 is not None and s.ttft_p99 > targets.ttft_seconds
    )


def judge(
    before: Score,
    after: Score,
    targets: Targets,
    *,
    slo_missed: bool,
    toward_default: bool,
    limits: JudgeLimits = JudgeLimits(),
) -> tuple[bool, str]:
    """(keep?, why). ``toward_default``: the change undoes an earlier one (fp8 off), so
    holding goodput is enough to keep it."""
    saturated = min(before.waiting, after.waiting) >= limits.saturated_queue
    hopeless = max(before.attainment, after.attainment) < limits.min_attainment
    if saturated and hopeless:
        # A queue already past the targets: every request misses them in both windows and
        # goodput reads 0 -> 0. What drains the queue, and so brings goodput back, is
        # throughput.
        measure, old, new = (
            "throughput (nothing met the targets)",
            before.throughput,
            after.throughput,
        )
    elif saturated:
        measure, old, new = "goodput", before.goodput, after.goodput
    else:
        measure, old, new = "SLO attainment", before.attainment, after.attainment
    ratio = new / old if old > 0 else (1.0 if new == 0 else float("inf"))
    facts = f"{measure} {old:.3g} -> {new:.3g} ({ratio:.2f}x)"
    if ratio >= 1 + limits.min_gain:
        return True, f"{facts}: better"
    restored = slo_missed and not misses_slo(after, targets)
    if restored and ratio >= 1 - limits.tolerance:
        return True, f"{facts}: the latency targets are met again"
    if toward_default and ratio >= 1 - limits.tolerance:
        return True, f"{facts}: no worse, and back toward the spec's settings"
    return False, f"{facts}: not better"
