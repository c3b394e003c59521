"""The laws in simulation: the real ClosedLoop (observe → tuner → arbiter → autoscaler →
apply) every 15 s against benchmarks/loopsim's replicas, for hours of simulated time.
Tuning is scored by what the replicas ran and served, not by the loop's Event reasons."""

from __future__ import annotations

import itertools

import pytest

from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.guardrails import TuneLimits
from benchmarks.loopsim import (
    ReplicaConfig,
    ServiceSim,
    SimResult,
    bursty,
    diurnal,
    steady,
    step_load,
)

BLOCK = 368_640  # bytes of one bfloat16 KV block of the bundled model
HOUR = 3600.0


def spec(engine=None, autoscaling=None, tuning=None):
    return parse_spec(
        {"engine": engine or {}, "autoscaling": autoscaling or {}, "tuning": tuning or {}}
    )


def assert_safe(result: SimResult, s) -> None:
    """Never out of bounds; planned changes (TuningTrial) a dwell apart and at most
    ``planned_per_hour`` an hour (guardrails move at once and are not counted, nor is a
    thrash lower, which is tested at once)."""
    lo, hi = s.tuning.max_num_seqs.min, s.tuning.max_num_seqs.max
    for point in result.trace:
        assert lo <= point.max_num_seqs <= hi, point
    limits = TuneLimits()
    planned = [
        t for t, reason, why in result.events if reason == "TuningTrial" and "KV thrash" not in why
    ]
    for a, b in itertools.pairwise(planned):
        assert b - a >= limits.dwell_seconds, planned
    for t in planned:
        assert sum(t - 3600 < u <= t for u in planned) <= limits.planned_per_hour, planned


def preemptions_between(result: SimResult, start: float, end: float) -> int:
    inside = [p for p in result.trace if start <= p.time <= end]
    return inside[-1].preemptions - inside[0].preemptions


# --------------------------------------------------------------------------- autoscaling


def test_a_load_step_is_served_by_added_replicas_within_the_up_window():
    s = spec(
        engine={"maxNumSeqs": 32},
        autoscaling={"enabled": True, "maxReplicas": 8, "scaleUpStabilizationSeconds": 30},
    )
    sim = ServiceSim(s, ReplicaConfig(), interval=15, startup_seconds=60)
    result = sim.run(step_load(0.5, 3.0, at=1200), duration=1.0 * HOUR)
    target = s.autoscaling.target_queue_length
    over = next(p.time for p in result.trace if p.time > 1200 and p.waiting > target)
    ups = result.changes("ScaledUp")
    assert ups, result.events
    # The first scale-up: the up-window after the queue passed its target, plus the scrape
    # interval it takes to see it.
    assert ups[0][0] - over <= 30 + 2 * 15
    # No flapping: the scale-ups, then (the surplus the queue asked for, released once a
    # replica's measured capacity says fewer carry the load) only scale-downs.
    kinds = [reason for _, reason, _ in result.changes("Scaled")]
    assert kinds == sorted(kinds, key=lambda r: r != "ScaledUp") and len(kinds) <= 6, kinds
    tail = [p for p in result.trace if p.time > 1200 + 900]
    assert max(p.waiting for p in tail[-20:]) <= target * tail[-1].ready_replicas
    assert tail[-1].ready_replicas >= 2


def test_steady_load_changes_nothing_for_two_hours_after_convergence():
    s = spec(
        engine={"maxNumSeqs": 16},
        autoscaling={"enabled": True, "maxReplicas": 6},
        tuning={"enabled": True, "maxNumSeqs": {"min": 4, "max": 64},
                "targetInterTokenLatencySeconds": 0.5},
    )  # fmt: skip
    converged = 1800.0
    result = ServiceSim(s, ReplicaConfig()).run(steady(2.5), duration=converged + 2 * HOUR)
    late = [e for e in result.events if e[0] > converged]
    assert late == [], late
    assert_safe(result, s)


def test_diurnal_and_bursty_loads_never_flap():
    s = spec(
        engine={"maxNumSeqs": 16},
        autoscaling={"enabled": True, "maxReplicas": 6},
        tuning={"enabled": True, "maxNumSeqs": {"min": 4, "max": 64},
                "targetInterTokenLatencySeconds": 0.5},
    )  # fmt: skip
    for workload in (diurnal(2.0, 1.6, period=2 * HOUR), bursty(1.5, burstiness=0.25)):
        result = ServiceSim(s, ReplicaConfig()).run(workload, duration=2 * HOUR)
        scaled = result.changes("Scaled")
        # A reversal (up then down or down then up) needs the down-window in between.
        for (t1, r1, _), (t2, r2, _) in itertools.pairwise(scaled):
            if r1 != r2:
                assert t2 - t1 >= s.autoscaling.scale_down_stabilization_seconds
        assert_safe(result, s)


# --------------------------------------------------------------------------- tuning


# A queue with every slot busy: the queue guardrail raises at once (no trial), to the
# model's plan once it can speak, and the queue drains.
def test_from_four_slots_the_tuner_raises_until_the_queue_drains():
    s = spec(
        engine={"maxNumSeqs": 4},
        tuning={"enabled": True, "maxNumSeqs": {"min": 2, "max": 32},
                "targetInterTokenLatencySeconds": 0.5},
    )  # fmt: skip
    # 1.2 requests/s of ~120 output tokens: one replica serves it with 32 slots, not with 4.
    result = ServiceSim(s, ReplicaConfig()).run(steady(1.2), duration=1.0 * HOUR)
    late = [p for p in result.trace if p.time > HOUR - 600]
    assert late[-1].max_num_seqs > 4
    assert max(p.waiting for p in late) <= 4 or late[-1].max_num_seqs == 32
    assert_safe(result, s)


@pytest.mark.parametrize("allow_fp8", [False, True], ids=["lower", "fp8"])
def test_an_oversized_max_num_seqs_that_thrashes_does_not_end_below_leaving_it_alone(allow_fp8):
    """240 blocks hold ten sequences at their longest (128 + 256 tokens), not 64: the
    replica thrashes, and the thrash guardrail lowers (or switches to fp8) at once. Swapping
    is cheap here, so fewer slots would serve less: whatever the loop does, it must not end
    below what the thrashing setting serves left alone."""
    tuning = {"allowFP8KVCache": allow_fp8, "maxNumSeqs": {"min": 2, "max": 128},
              "targetInterTokenLatencySeconds": 0.5}  # fmt: skip
    config = ReplicaConfig(kv_cache_bytes=240 * BLOCK)
    left_alone = ServiceSim(spec({"maxNumSeqs": 64}, tuning=tuning), config)
    tuned = ServiceSim(spec({"maxNumSeqs": 64}, tuning={"enabled": True, **tuning}), config)
    fixed = left_alone.run(steady(1.0), duration=1.0 * HOUR)
    result = tuned.run(steady(1.0), duration=1.0 * HOUR)
    assert preemptions_between(fixed, 0, HOUR) >= 100  # it does thrash
    assert result.trials(), "the loop tried nothing against the thrash"
    assert result.goodput() >= 0.95 * fixed.goodput()
    if allow_fp8:  # an fp8 trial rolls the replicas onto the fp8 template
        assert any(p.kv_cache_dtype == "fp8" for p in result.trace)
    assert_safe(result, s=tuned.spec)
