"""The pure control laws, decision by decision: autoscale.decide_replicas and
tune.decide_tuning on hand-made windows, plus properties over random ones."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.operator.autoscale import Recommendation, ScaleHistory, decide_replicas
from batchpilot.operator.crd import AutoscalingSpec, TuningSpec
from batchpilot.operator.observe import Window
from batchpilot.operator.tune import EngineSettings, TuneRecord, decide_tuning


def window(
    *,
    replicas=1,
    running=0.0,
    waiting=0.0,
    kv=0.1,
    kv_peak=None,
    preemptions=0.0,
    swaps=0.0,
    itl_p99=None,
    tokens=0.0,
    max_num_seqs=8,
    span=60.0,
) -> Window:
    """Totals over ``replicas`` (running/waiting are per replica here, for readability)."""
    itl = () if itl_p99 is None else ((0.0, 0.0), (itl_p99 / 0.99, 1e3), (math.inf, 1e3))
    return Window(
        replicas=replicas,
        span_seconds=span,
        waiting=waiting * replicas,
        running=running * replicas,
        swapped=0.0,
        kv_cache_usage=kv,
        kv_cache_usage_peak=kv if kv_peak is None else kv_peak,
        preemptions_per_minute=preemptions * replicas,
        swaps_per_minute=swaps * replicas,
        generation_tokens_per_second=tokens * replicas,
        waiting_now=waiting * replicas,
        running_now=running * replicas,
        itl_buckets=itl,
        max_num_seqs={f"http://r{i}": max_num_seqs for i in range(replicas)},
    )


# --------------------------------------------------------------------------- autoscale

SCALE = AutoscalingSpec(
    enabled=True,
    min_replicas=1,
    max_replicas=8,
    target_queue_length=4,
    scale_up_stabilization_seconds=30,
    scale_down_stabilization_seconds=300,
)


def run_scaler(w, current: int, ticks: int, interval=10.0, spec=SCALE, start=0.0):
    """Feed the same window (or ``w(current)``: a window of that many Ready replicas) every
    interval; apply each decision. Returns the replica counts."""
    history, counts = ScaleHistory(), []
    for i in range(ticks):
        seen = w(current) if callable(w) else w
        d = decide_replicas(seen, spec, current, start + i * interval, history)
        history, current = d.history, d.replicas
        counts.append(current)
    return counts


def test_a_queue_over_target_scales_up_after_the_up_window():
    busy = window(running=8, waiting=20)  # 28 in the system, 12 per replica fits
    counts = run_scaler(busy, current=1, ticks=6)
    assert counts[:3] == [1, 1, 1]  # 0, 10, 20 s: still inside the 30 s up-window
    assert counts[3] == 3  # ceil(28 / 12), within the step of +2


def test_scale_up_is_bounded_per_decision():
    def flood(ready: int) -> Window:  # new pods Ready at once, the same total queue
        return window(replicas=ready, running=8, waiting=400 / ready)

    counts = run_scaler(flood, current=1, ticks=12)
    for before, after in itertools.pairwise([1, *counts]):
        assert after - before <= max(2, before)  # +2 or doubling, whichever is more
    assert counts[-1] == 8  # capped at max_replicas


def test_further_scale_ups_wait_for_starting_pods_within_a_grace():
    flood = window(replicas=1, running=8, waiting=400)  # the new pods never get Ready
    counts = run_scaler(flood, current=1, ticks=130)
    assert counts[3] == 3 and counts[60] == 3  # held while they start
    assert counts[-1] > 3  # after STARTUP_GRACE_SECONDS they no longer block


def test_scale_down_waits_for_the_down_window():
    idle = window(replicas=4, running=1, waiting=0, max_num_seqs=8)
    counts = run_scaler(idle, current=4, ticks=40)
    first_change = next(i for i, c in enumerate(counts) if c != 4)
    assert first_change * 10 >= 300
    assert counts[-1] < 4


def test_zero_stabilization_windows_act_on_the_latest_recommendation():
    spec = SCALE.model_copy(
        update={"scale_up_stabilization_seconds": 0, "scale_down_stabilization_seconds": 0}
    )
    assert run_scaler(window(running=8, waiting=20), 1, ticks=1, spec=spec) == [3]
    assert run_scaler(window(replicas=4, running=1), 4, ticks=1, spec=spec) == [2]


def test_within_tolerance_holds():
    w = window(replicas=2, running=8, waiting=4.2)  # 12.2 per replica against 12
    assert run_scaler(w, current=2, ticks=40) == [2] * 40


def test_bounds_hold_even_when_the_current_count_is_outside_them():
    spec = SCALE.model_copy(update={"min_replicas": 2, "max_replicas": 3})
    idle = window(running=0, waiting=0)
    assert decide_replicas(idle, spec, 1, 0.0).replicas == 2
    assert decide_replicas(idle, spec, 6, 0.0).replicas == 3


def test_kv_limited_replicas_count_the_sequences_their_kv_holds():
    # max_num_seqs 32, but 8 running fill 80% of the KV cache: 10 slots, not 32.
    w = window(running=8, waiting=20, kv=0.8, max_num_seqs=32)
    d = decide_replicas(w, SCALE, 1, 100.0, ScaleHistory((Recommendation(3, 80.0),)))
    assert d.recommendation == 2  # 28 / (10 + 4)


def test_measured_capacity_blocks_a_scale_down_that_could_not_carry_the_load():
    # Four replicas, little queued, but the service generates 600 tokens/s and one replica
    # was measured sustaining 250: two replicas would be at 300 each, over 90% of 250.
    busy = window(replicas=4, running=6, waiting=0, tokens=150, max_num_seqs=32)
    history = ScaleHistory((), capacity=250.0)
    counts = []
    current = 4
    for i in range(60):
        d = decide_replicas(busy, SCALE, current, i * 10.0, history)
        history, current = d.history, d.replicas
        counts.append(current)
    assert min(counts) == 3  # ceil(600 / 225)


def test_capacity_is_measured_only_while_saturated():
    saturated = window(running=8, waiting=5, tokens=200)
    d = decide_replicas(saturated, SCALE, 1, 0.0)
    assert d.history.capacity == 200
    calm = window(running=3, waiting=0, tokens=50)
    assert decide_replicas(calm, SCALE, 1, 10.0, d.history).history.capacity == 200


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.integers(1, 6),
    running=st.floats(0, 64),
    waiting=st.floats(0, 200),
    kv=st.floats(0, 1),
    mns=st.integers(1, 64),
    current=st.integers(1, 8),
)
def test_under_steady_metrics_the_count_moves_one_way_and_stays_in_bounds(
    replicas, running, waiting, kv, mns, current
):
    w = window(replicas=replicas, running=running, waiting=waiting, kv=kv, max_num_seqs=mns)
    counts = run_scaler(w, current, ticks=80)
    assert all(SCALE.min_replicas <= c <= SCALE.max_replicas for c in counts)
    deltas = [b - a for a, b in itertools.pairwise(counts) if b != a]
    assert all(d > 0 for d in deltas) or all(d < 0 for d in deltas)  # never flaps


# --------------------------------------------------------------------------- tune

TUNE = TuningSpec(
    enabled=True,
    max_num_seqs={"min": 2, "max": 64},
    allow_fp8_kv_cache=False,
    target_inter_token_latency_seconds=0.1,
    cooldown_seconds=120,
)
AT8 = EngineSettings(8, "auto")


def test_slot_bound_raises_at_most_double():
    d = decide_tuning(window(running=8, waiting=5, kv=0.1), TUNE, AT8, 1000.0)
    assert (d.kind, d.max_num_seqs) == ("raise", 16)
    assert d.inputs["waitingPerReplica"] == 5


def test_a_raise_stops_where_the_kv_peak_would_pass_its_bound():
    d = decide_tuning(window(running=8, waiting=5, kv=0.3, kv_peak=0.6), TUNE, AT8, 1000.0)
    assert d.max_num_seqs == math.floor(8 * 0.85 / 0.6)  # 11, not 16


def test_a_raise_respects_the_spec_maximum():
    d = decide_tuning(window(running=60, waiting=5, kv=0.1), TUNE, EngineSettings(60), 1000.0)
    assert d.max_num_seqs == 64


def test_no_raise_without_a_queue_with_preemption_or_without_latency_headroom():
    assert decide_tuning(window(running=8, waiting=0), TUNE, AT8, 1000.0).kind == "hold"
    assert decide_tuning(window(running=4, waiting=5), TUNE, AT8, 1000.0).kind == "hold"
    assert (
        decide_tuning(window(running=8, waiting=5, preemptions=1), TUNE, AT8, 1000.0).kind == "hold"
    )
    tight = window(running=8, waiting=5, itl_p99=0.09)  # under 0.1 but over 0.8 x 0.1
    assert decide_tuning(tight, TUNE, AT8, 1000.0).kind == "hold"


def test_thrash_lowers_below_the_batch_that_runs():
    thrash = window(running=12, waiting=10, preemptions=20, kv=0.95)
    d = decide_tuning(thrash, TUNE, EngineSettings(64), 1000.0)
    assert (d.kind, d.max_num_seqs) == ("lower", 9)  # 0.75 x 12, not 0.75 x 64
    assert "memory-bound" in d.reason


def test_thrash_while_the_old_batch_drains_under_a_new_limit_holds():
    draining = window(running=5, preemptions=20)  # lowered to 3, five still finishing
    d = decide_tuning(draining, TUNE, EngineSettings(3), 1000.0)
    assert d.kind == "hold" and "draining" in d.reason


def test_thrash_prefers_fp8_when_allowed_and_lowers_once_fp8_is_on():
    spec = TUNE.model_copy(update={"allow_fp8_kv_cache": True})
    thrash = window(running=12, preemptions=20)
    d = decide_tuning(thrash, spec, EngineSettings(64, "auto"), 1000.0)
    assert (d.kind, d.kv_cache_dtype, d.max_num_seqs) == ("fp8", "fp8", 64)
    d = decide_tuning(thrash, spec, EngineSettings(64, "fp8"), 1000.0)
    assert d.kind == "lower"


def test_latency_over_target_lowers():
    d = decide_tuning(window(running=8, waiting=0, itl_p99=0.2), TUNE, AT8, 1000.0)
    assert (d.kind, d.max_num_seqs) == ("lower", 6)


def test_a_p99_over_too_few_gaps_is_not_a_latency_level():
    few = window(running=8, waiting=0, itl_p99=0.2)
    few = replace(few, itl_buckets=tuple((le, n / 10) for le, n in few.itl_buckets))
    assert decide_tuning(few, TUNE, AT8, 1000.0).kind == "hold"


def test_kv_full_with_a_queue_switches_to_fp8_only_when_allowed():
    full = window(running=6, waiting=5, kv=0.97)
    assert decide_tuning(full, TUNE, AT8, 1000.0).kind == "hold"
    spec = TUNE.model_copy(update={"allow_fp8_kv_cache": True})
    assert decide_tuning(full, spec, AT8, 1000.0).kind == "fp8"


def test_the_minimum_bound_holds():
    d = decide_tuning(window(running=2, preemptions=30), TUNE, EngineSettings(2), 1000.0)
    assert (d.kind, d.max_num_seqs) == ("hold", 2)


def test_cooldown_and_a_short_window_hold():
    last = TuneRecord(time=950.0, kind="raise", max_num_seqs=8, previous_max_num_seqs=4,
                      kv_cache_dtype="auto")  # fmt: skip
    busy = window(running=8, waiting=5)
    d = decide_tuning(busy, TUNE, AT8, 1000.0, [last])
    assert d.kind == "hold" and "cooldown" in d.reason
    assert decide_tuning(window(running=8, waiting=5, span=5), TUNE, AT8, 1000.0).kind == "hold"


def test_a_lowered_value_caps_raises_for_the_memory_window():
    lowered = TuneRecord(time=0.0, kind="lower", max_num_seqs=8, previous_max_num_seqs=16,
                         kv_cache_dtype="auto")  # fmt: skip
    busy = window(running=8, waiting=5)
    assert decide_tuning(busy, TUNE, AT8, 600.0, [lowered]).kind == "hold"
    assert decide_tuning(busy, TUNE, AT8, 4000.0, [lowered]).kind == "raise"
    # A lower under another KV dtype says nothing about this one.
    assert decide_tuning(busy, TUNE, EngineSettings(8, "fp8"), 600.0, [lowered]).kind == "raise"


@settings(max_examples=300, deadline=None)
@given(
    mns=st.integers(2, 64),
    running=st.floats(0, 80),
    waiting=st.floats(0, 50),
    kv=st.floats(0, 1),
    preemptions=st.floats(0, 30),
    itl=st.one_of(st.none(), st.floats(0.001, 1)),
)
def test_every_decision_stays_in_bounds_with_a_bounded_step(
    mns, running, waiting, kv, preemptions, itl
):
    w = window(running=running, waiting=waiting, kv=kv, preemptions=preemptions, itl_p99=itl)
    d = decide_tuning(w, TUNE, EngineSettings(mns), 1000.0)
    lo, hi = TUNE.max_num_seqs.min, TUNE.max_num_seqs.max
    assert lo <= d.max_num_seqs <= hi
    assert d.max_num_seqs <= 2 * mns
    if d.kind == "lower":
        assert d.max_num_seqs >= max(lo, math.floor(0.75 * min(mns, running)))
    if d.kind == "hold":
        assert d.max_num_seqs == mns
