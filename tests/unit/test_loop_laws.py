"""The pure control laws, decision by decision: autoscale.decide_replicas (capacity per
engine settings), the tuner's guardrails (guardrails.py, through tune.decide_tuning: the
moves made at once, only in the safe direction), the arbiter between tuner and autoscaler
(turn.arbitrate, turn.blindness), plus properties over random windows. The planned changes
and their no-harm test are in test_tuner_experiments.py, the models in test_loop_v3.py."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.operator.crd.autoscaling import AutoscalingSpec
from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop import guardrails as guard
from batchpilot.operator.loop.autoscale import (
    Recommendation,
    ScaleDecision,
    ScaleHistory,
    decide_replicas,
)
from batchpilot.operator.loop.guardrails import TuneLimits, thrash_per_1k
from batchpilot.operator.loop.model_state import ModelState
from batchpilot.operator.loop.observe import RoundResult, Window, merge_windows
from batchpilot.operator.loop.planner import Bounds, plan
from batchpilot.operator.loop.state import TunerState
from batchpilot.operator.loop.tune import View, decide_tuning
from batchpilot.operator.loop.tuner_state import EngineSettings, Experiment, TuneDecision
from batchpilot.operator.loop.turn import (
    EMERGENCY_QUEUE_FACTOR,
    ENGINE_CHANGE_FREEZE_SECONDS,
    arbitrate,
    blindness,
)
from tests.support.loop import ready_model, replica, step_cells, window, within

# --------------------------------------------------------------------------- autoscale

SCALE = AutoscalingSpec(
    enabled=True,
    min_replicas=1,
    max_replicas=8,
    target_queue_length=4,
    scale_up_stabilization_seconds=30,
    scale_down_stabilization_seconds=300,
)


def run_scaler(
    w, current: int, ticks: int, interval=10.0, spec=SCALE, start=0.0, history=None, settings=None
):
    """Feed the same window (or ``w(current)``: a window of that many Ready replicas) every
    interval; apply each decision. Returns the replica counts."""
    history, counts = history or ScaleHistory(), []
    for i in range(ticks):
        seen = w(current) if callable(w) else w
        d = decide_replicas(seen, spec, current, start + i * interval, history, settings)
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


AT8, AT32 = EngineSettings(8), EngineSettings(32)
AT8_KEY, AT32_KEY = AT8.key, AT32.key


def test_measured_capacity_blocks_a_scale_down_that_could_not_carry_the_load():
    # Four replicas, little queued, but the service generates 600 tokens/s and one replica
    # was measured sustaining 250 under these settings: two replicas would be at 300 each,
    # over 90% of 250.
    busy = window(replicas=4, running=6, waiting=0, tokens=150, max_num_seqs=32)
    history = ScaleHistory((), ((AT32_KEY, 250.0),))
    counts = run_scaler(busy, 4, ticks=60, history=history, settings=AT32)
    assert min(counts) == 3  # ceil(600 / 225)


def test_a_capacity_measured_under_other_settings_does_not_block_a_scale_down():
    busy = window(replicas=4, running=6, waiting=0, tokens=150, max_num_seqs=32)
    history = ScaleHistory((), ((AT8_KEY, 250.0),))  # measured at max_num_seqs 8
    counts = run_scaler(busy, 4, ticks=60, history=history, settings=AT32)
    assert min(counts) == 1  # by slots alone: 24 in the system, 36 per replica
    # ... and the figure under the other settings is kept, not overwritten.
    d = decide_replicas(busy, SCALE, 4, 0.0, history, AT32)
    assert d.history.capacity(AT8_KEY) == 250.0 and d.history.capacity(AT32_KEY) is None


def test_capacity_is_measured_only_while_saturated_and_per_settings():
    saturated = window(running=8, waiting=5, tokens=200)
    d = decide_replicas(saturated, SCALE, 1, 0.0, settings=AT8)
    assert d.history.capacity(AT8_KEY) == 200 and d.history.capacity(AT32_KEY) is None
    calm = window(running=3, waiting=0, tokens=50)
    assert decide_replicas(calm, SCALE, 1, 10.0, d.history, AT8).history.capacity(AT8_KEY) == 200
    # Saturated under other settings: a second figure, the first one kept.
    d2 = decide_replicas(
        window(running=32, waiting=5, tokens=500, max_num_seqs=32),
        SCALE,
        1,
        20.0,
        d.history,
        AT32,
    )
    assert d2.history.capacity(AT8_KEY) == 200 and d2.history.capacity(AT32_KEY) == 500


def test_a_capacity_is_credited_to_the_settings_that_ran_not_to_those_just_chosen():
    """The turn that raises max_num_seqs reads a window that ran at the old setting: the
    rate measured in it is the old setting's (at 420 s of the step workload the GPU
    plant's 2,435 tokens/s at 32 was filed under 143 and held four replicas where two
    carried the load)."""
    saturated = window(running=8, waiting=5, tokens=200)
    d = decide_replicas(saturated, SCALE, 1, 0.0, settings=AT32, measured=(AT8_KEY, [saturated]))
    assert d.history.capacity(AT8_KEY) == 200 and d.history.capacity(AT32_KEY) is None


def test_the_queue_law_counts_the_slots_the_tuner_just_chose():
    """One capacity model: in the turn the tuner raises max_num_seqs, the queue is sized
    against the new slots, not the ones the replicas still report."""
    w = window(running=8, waiting=20, max_num_seqs=8)  # 28 in the system
    assert decide_replicas(w, SCALE, 1, 0.0).recommendation == 3  # 28 / (8 + 4)
    assert decide_replicas(w, SCALE, 1, 0.0, settings=AT32).recommendation == 1  # 28 / 36


def test_a_queue_drained_in_the_window_or_seen_once_measures_no_capacity():
    drained = replace(window(running=30, waiting=40, tokens=900), waiting_now=0.0)
    once = window(running=20, waiting=1, tokens=300, span=15.0)
    for w in (drained, once):
        d = decide_replicas(w, SCALE, 1, 0.0, settings=AT32, measured=(AT32_KEY, [w]))
        assert d.history.capacity(AT32_KEY) is None
    # Per replica: the mean rate of those with a queue all through, not of every replica.
    busy, idle = window(running=32, waiting=5, tokens=500), window(running=2, tokens=40)
    d = decide_replicas(busy, SCALE, 2, 0.0, settings=AT32, measured=(AT32_KEY, [busy, idle]))
    assert d.history.capacity(AT32_KEY) == 500


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


# --------------------------------------------------------------------------- guardrails

TUNE = parse_spec(
    {
        "engine": {"maxNumSeqs": 8},
        "slo": {"interTokenLatencySeconds": 0.1, "timeToFirstTokenSeconds": 2.0},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 2, "max": 64}},
    }
)
TUNE_FP8 = TUNE.model_copy(
    update={"tuning": TUNE.tuning.model_copy(update={"allow_fp8_kv_cache": True})}
)
AT8 = EngineSettings(8, "auto")
LIMITS = TuneLimits()
R0 = "http://r0"


def decide(w: Window, spec=TUNE, settings=AT8, state: TunerState | None = None, now=1000.0):
    """One turn on one replica's window, which is also what the model learns from."""
    v = View(service=w, replicas={R0: w}, latest=w)
    return decide_tuning(v, spec, state or TunerState(settings=settings), settings, now)


def guarded(w: Window, spec=TUNE, settings=AT8, state=None) -> tuple[str, EngineSettings]:
    """(kind, settings) of a guardrail's move, or ("hold", the settings in force). A thrash
    lower before the model knows the KV cap is tested before it stays: its settings are the
    test's."""
    d, st = decide(w, spec, settings, state)
    if st.experiment is not None:
        assert d.action == "try" and d.reason.startswith("testing: KV thrash"), d.reason
        return d.kind, st.experiment.after
    return (d.kind, d.settings) if d.action == "guard" else ("hold", d.settings)


def busy(**kw) -> Window:
    """Every slot of 8 busy, a queue of 3 (under half the batch: not deep), no thrash."""
    kw = {"running": 8, "waiting": 3, "kv": 0.1, **kw}
    return replica(R0, **kw)


def queue_state(*waiting: float, model=None, settings=AT8) -> TunerState:
    m = model or ModelState()
    return TunerState(settings=settings, model=replace(m, queue=tuple(waiting)))


def test_a_queue_raises_only_once_it_persists_or_is_deep():
    # The first turn of a shallow queue: held (one window of a queue may be a burst).
    d, st = decide(busy())
    assert d.action == "hold" and st.model.queue == (3.0,)
    # The next turn it is still there: raised at once, no trial, no verdict.
    d, st2 = decide(busy(), state=st, now=1015.0)
    assert (d.action, d.kind, d.settings) == ("guard", "raise", EngineSettings(16))
    assert d.reason.startswith("guardrail: queue:") and "model not ready" in d.reason
    assert st2.settings == EngineSettings(16) and st2.experiment is None and st2.verdicts == ()
    assert d.inputs["waitingPerReplica"] == 3 and d.inputs["maxNumSeqs"] == 8
    # As deep as half the batch: at once.
    assert guarded(busy(waiting=4)) == ("raise", EngineSettings(16))


def test_no_raise_without_busy_slots_or_with_any_thrash():
    persisted = queue_state(3, 3)
    assert guarded(busy(running=6), state=persisted)[0] == "hold"  # under 85 % of 8 busy
    assert guarded(busy(waiting=0.2), state=queue_state(3, 0.2))[0] == "hold"
    # Preempting at all (0.5 per 1,000 tokens, under the thrash bound) blocks a raise.
    assert guarded(busy(preemptions=3), state=persisted)[0] == "hold"


def test_a_queue_raise_goes_at_once_to_the_plans_cap_and_is_never_a_lower():
    model = ready_model()
    w = busy(waiting=3)
    p = plan(model.fit(), model.demand, 0.1, Bounds(2, 64), 8, None, (None, None))
    assert p.max_num_seqs > 16  # more than doubling: one move, not x2 steps
    got = guard.queue(w, {R0: w}, AT8, TUNE, replace(model, queue=(3, 3)), p, LIMITS, 1000.0)
    assert (got.kind, got.settings.max_num_seqs) == ("raise", p.max_num_seqs)
    assert "the model's plan" in got.reason
    # Through the tuner, the same.
    kind, s = guarded(w, state=queue_state(3, model=model))
    assert (kind, s.max_num_seqs) == ("raise", p.max_num_seqs)
    # A plan under today's setting: no move at all (the queue guardrail only raises).
    small = replace(p, max_num_seqs=4)
    assert (
        guard.queue(w, {R0: w}, AT8, TUNE, replace(model, queue=(3, 3)), small, LIMITS, 1000.0)
        is None
    )


def test_a_queue_raise_stops_at_the_kv_peak_the_spec_maximum_and_the_step_budget():
    state = queue_state(3, 3)
    assert guarded(busy(kv=0.3, kv_peak=0.6), state=state) == (
        "raise", EngineSettings(math.floor(8 * 0.85 / 0.6))
    )  # 11, not 16  # fmt: skip
    s60 = EngineSettings(60)
    at60 = queue_state(3, 3, settings=s60)
    assert guarded(busy(running=60, max_num_seqs=60), settings=s60, state=at60) == (
        "raise", EngineSettings(64)
    )  # fmt: skip
    # A step holds one token of every running sequence: no more sequences than the budget.
    capped = EngineSettings(8, "auto", 12)
    w = busy(budget=12)
    assert guarded(w, settings=capped, state=queue_state(3, 3, settings=capped)) == (
        "raise", EngineSettings(12, "auto", 12)
    )  # fmt: skip


def test_with_the_models_kv_cap_a_full_kv_cache_does_not_stop_a_queue_raise():
    # A KV-bound replica: every slot of 8 busy and the cache at 90 % at its peak. The peak
    # alone would stop the raise at 8 x 0.85 / 0.9 = 7; the model's KV cap (the blocks over
    # a sequence's mean occupancy) is what the scheduler admits to, and the raise goes there.
    model = replace(ready_model(), queue=(3, 3))
    w = busy(kv=0.9, kv_peak=0.9)
    p = plan(model.fit(), model.demand, 0.1, Bounds(2, 64), 8, None, (None, None))
    assert guard.queue(w, {R0: w}, AT8, TUNE, model, p, LIMITS, 1000.0) is None  # the peak binds
    kv = replace(p, max_num_seqs=12, kv_cap=12)
    got = guard.queue(w, {R0: w}, AT8, TUNE, model, kv, LIMITS, 1000.0)
    assert (got.kind, got.settings.max_num_seqs) == ("raise", 12), got


def test_before_the_model_a_deep_queue_gets_room_for_all_of_it_at_once():
    # 8 running and 20 waiting: 28 slots in one move, not 16 now and 32 a turn later.
    assert guarded(busy(waiting=20)) == ("raise", EngineSettings(28))
    # The KV cache's peak still bounds it: 8 sequences filled 40 %, so 17 fit at 85 %.
    assert guarded(busy(waiting=20, kv_peak=0.4)) == ("raise", EngineSettings(17))


def test_overloaded_at_the_plan_the_queue_raises_past_it_to_the_kv_cap_within_reach():
    # Arrivals twice what the plan completes within the SLO, and a backlog (the oldest
    # queued request 4 s old against the 2 s TTFT target): queued requests miss their TTFT
    # at any batch, so the latency cap gives way to the KV cap, as far as the model reaches
    # (twice the largest batch it has seen, 16 here: 32).
    model = ready_model()
    p = plan(model.fit(), model.demand, 0.1, Bounds(2, 64), 8, None, (2000, 16))
    assert p.reach == 32 and p.kv_cap > 32
    at_plan = EngineSettings(p.max_num_seqs)
    w = busy(running=p.max_num_seqs, max_num_seqs=p.max_num_seqs, waiting=p.max_num_seqs,
             oldest_waiting=4.0)  # fmt: skip
    calm = replace(model, queue=(3, 3))
    assert guard.queue(w, {R0: w}, at_plan, TUNE, calm, p, LIMITS, 1000.0) is None  # not overloaded
    hot = replace(calm, demand=replace(model.demand, rate=2 * p.capacity))
    got = guard.queue(w, {R0: w}, at_plan, TUNE, hot, p, LIMITS, 1000.0)
    assert got.settings.max_num_seqs == 32 > p.max_num_seqs
    assert "overloaded" in got.reason
    # A young queue (clients that give up before the TTFT target keep it so): requests
    # admitted past the plan would miss their TPOT and none queued misses its TTFT.
    young = replace(w, oldest_waiting_seconds=2.9)
    assert guard.queue(young, {R0: young}, at_plan, TUNE, hot, p, LIMITS, 1000.0) is None
    # A small KV cache binds first.
    small = replace(p, kv_cap=p.max_num_seqs + 3)
    got = guard.queue(w, {R0: w}, at_plan, TUNE, hot, small, LIMITS, 1000.0)
    assert got.settings.max_num_seqs == p.max_num_seqs + 3
    # The same when the queue grows three turns running at the plan, whatever the rate says.
    growing = replace(calm, queue=(3, 5, 9))
    assert (
        guard.queue(w, {R0: w}, at_plan, TUNE, growing, p, LIMITS, 1000.0).settings.max_num_seqs
        == 32
    )
    # Below the plan a growing queue raises to the plan first.
    below = EngineSettings(p.max_num_seqs // 2)
    w = busy(running=below.max_num_seqs, max_num_seqs=below.max_num_seqs, waiting=3)
    got = guard.queue(w, {R0: w}, below, TUNE, growing, p, LIMITS, 1000.0)
    assert got.settings.max_num_seqs == p.max_num_seqs


def test_the_queue_guardrail_reads_the_last_turn_and_acts_on_the_first_15_seconds():
    # Since the last change the service was mostly idle (2 running on average), but in the
    # last turn every slot was busy with a queue: the last turn decides.
    quiet, now_busy = replica(R0, running=2, waiting=0.1), busy(waiting=6, span=15.0)
    v = View(service=quiet, replicas={R0: quiet}, latest=now_busy)
    d, _ = decide_tuning(v, TUNE, queue_state(6), AT8, 1000.0)
    assert (d.action, d.kind, d.settings) == ("guard", "raise", EngineSettings(16))
    # A first window of 15 s (every other decision waits for 30 s): the queue still raises.
    v = View(service=now_busy, replicas={R0: now_busy}, latest=now_busy)
    d, _ = decide_tuning(v, TUNE, queue_state(6), AT8, 1000.0)
    assert (d.action, d.kind) == ("guard", "raise")
    calm = replica(R0, running=2, span=15.0)
    v = View(service=calm, replicas={R0: calm}, latest=calm)
    d, _ = decide_tuning(v, TUNE, TunerState(settings=AT8), AT8, 1000.0)
    assert d.action == "hold" and d.reason.startswith("observing: 15 s")


def test_a_deep_queue_raises_on_the_first_scrape_and_a_shallow_one_waits():
    # One scrape (no span, no turn before it: the model has no queue yet) with every slot
    # busy and a queue of half the batch: raised at once, a loop interval earlier.
    first = busy(waiting=6, span=0.0)
    v = View(service=first, replicas={R0: first}, latest=first)
    d, st = decide_tuning(v, TUNE, TunerState(settings=AT8), AT8, 1000.0)
    assert (d.action, d.kind, d.settings) == ("guard", "raise", EngineSettings(16))
    assert st.model.queue == ()  # nothing learnt from a window with no span
    # A shallow queue in the first scrape is held: it may be a burst.
    shallow = busy(waiting=2, span=0.0)
    v = View(service=shallow, replicas={R0: shallow}, latest=shallow)
    d, _ = decide_tuning(v, TUNE, TunerState(settings=AT8), AT8, 1000.0)
    assert d.action == "hold"


def test_thrash_lowers_to_what_the_kv_cache_held_at_most_halving():
    # 12 running filled 95 % of the cache: it holds 10 at 85 %.
    thrash = replica(R0, running=12, preemptions=20, kv=0.95, tokens=50, max_num_seqs=16)
    kind, s = guarded(thrash, settings=EngineSettings(16))
    assert (kind, s) == ("lower", EngineSettings(10))
    # From 64 the same thrash goes to 32, not 10: at most halving in one move.
    thrash = replace(thrash, max_num_seqs={R0: 64})
    assert guarded(thrash, settings=EngineSettings(64)) == ("lower", EngineSettings(32))
    d, _ = decide(thrash, settings=EngineSettings(64))
    # Tested at once: with no model the cap is one peak's, and swaps may be cheap.
    assert d.reason.startswith("testing: KV thrash:")


def test_thrash_past_the_models_kv_cap_lowers_at_once_without_a_test():
    # 400 blocks of 16 tokens hold 20 sequences of 200 + 100 / 2 tokens at 85 %: the model
    # puts 64 past what the cache holds, so the lower is a guardrail (at most halving). A
    # before/after test of a thrashing replica reads its backlog, not the lower.
    thrash = replica(R0, running=60, preemptions=20, kv=0.95, tokens=50, max_num_seqs=64,
                     kv_blocks=400)  # fmt: skip
    state = TunerState(settings=EngineSettings(64), model=ready_model())
    d, after = decide(thrash, settings=EngineSettings(64), state=state)
    assert (d.action, d.kind, d.settings) == ("guard", "lower", EngineSettings(32)), d.reason
    assert d.reason.startswith("guardrail: KV thrash") and after.experiment is None


def test_thrash_while_the_old_batch_drains_under_a_new_limit_holds():
    draining = replica(R0, running=5, preemptions=20, tokens=50, max_num_seqs=3)
    assert guarded(draining, settings=EngineSettings(3)) == ("hold", EngineSettings(3))


def test_thrash_prefers_fp8_when_allowed_and_lowers_once_fp8_is_on():
    thrash = replica(R0, running=12, preemptions=20, tokens=50, kv=0.95, max_num_seqs=16)
    s16 = EngineSettings(16)
    assert guarded(thrash, TUNE_FP8, s16) == ("fp8", EngineSettings(16, "fp8"))
    on = replica(R0, running=12, preemptions=20, tokens=50, kv=0.95, max_num_seqs=16, dtype="fp8")
    assert guarded(on, TUNE_FP8, EngineSettings(16, "fp8")) == ("lower", EngineSettings(10, "fp8"))


def test_the_minimum_bound_holds():
    low = replica(R0, running=2, preemptions=30, tokens=50, max_num_seqs=2)
    assert guarded(low, settings=EngineSettings(2)) == ("hold", EngineSettings(2))


def test_thrash_is_per_thousand_tokens_so_it_carries_over_to_gpus():
    # 30 preemptions a minute: 5 per 1,000 tokens at 100 tokens/s (a CPU), thrash;
    # 0.1 per 1,000 at 5,000 tokens/s (a GPU), not.
    cpu = replica(R0, running=6, preemptions=30, tokens=100, kv=0.9)
    gpu = replica(R0, running=6, preemptions=30, tokens=5000, kv=0.9)
    assert thrash_per_1k(cpu) == pytest.approx(5.0) and thrash_per_1k(gpu) == pytest.approx(0.1)
    assert guarded(cpu)[0] == "lower"
    assert guarded(gpu)[0] == "hold"
    assert thrash_per_1k(replica(preemptions=1, tokens=0)) == math.inf
    assert thrash_per_1k(replica(tokens=0)) == 0.0


def test_thrash_on_the_worst_replica_counts_though_the_mean_is_under_the_bound():
    reps = {f"http://r{i}": replica(f"http://r{i}", running=6) for i in range(4)}
    reps[R0] = replica(R0, running=6, preemptions=18, tokens=100, kv=0.9)
    service = merge_windows(list(reps.values()))
    assert thrash_per_1k(service) < LIMITS.thrash_per_1k_tokens
    d, _ = decide_tuning(View(service, reps, service), TUNE_FP8, TunerState(), AT8, 1000.0)
    assert (d.action, d.kind, d.settings) == ("guard", "fp8", EngineSettings(8, "fp8"))
    assert d.inputs["thrashPer1kTokensWorstReplica"] == pytest.approx(3.0)


# The model of test_loop_v3's known plant, seen up to batch 16: at batch 32 its step is
# 93 ms, its lower bound 83 ms.
SLOW = replica(R0, running=32, max_num_seqs=32, tpot_share=0.5, target=0.06, finished=100)
S32 = EngineSettings(32)


def latency_spec(target: float):
    return TUNE.model_copy(update={"slo": TUNE.slo.model_copy(
        update={"inter_token_latency_seconds": target})})  # fmt: skip


def latency(w=SLOW, target=0.06, model=None, now=1000.0):
    spec, model = latency_spec(target), model or ready_model()
    fit = model.fit()
    p = plan(fit, model.demand, target, Bounds(2, 64), 32, None, (None, None))
    return guard.latency(w, S32, spec, model, fit, p, now, LIMITS)


def test_a_latency_miss_the_model_blames_on_the_batch_lowers_at_most_halving():
    got = latency()
    assert got.kind == "lower" and got.settings == EngineSettings(16)  # the cap is lower still
    assert got.reason.startswith("latency: 50% of 100 requests met the 60 ms TPOT target")
    # Through the tuner, at once.
    state = TunerState(settings=S32, model=ready_model())
    d, _ = decide(SLOW, latency_spec(0.06), S32, state)
    assert (d.action, d.kind, d.settings) == ("guard", "lower", EngineSettings(16))


def test_no_latency_lower_unless_the_model_is_sure_the_batch_is_to_blame():
    # At 95 ms the model's mean step at batch 32 (93 ms) meets the target: the miss may be
    # the machine's or the prompts', not the batch's. At 90 ms the model puts it on the batch.
    assert latency(target=0.095) is None
    state = TunerState(settings=S32, model=ready_model())
    assert decide(SLOW, latency_spec(0.095), S32, state)[0].action == "hold"
    assert latency(target=0.09).kind == "lower"
    # A model that saw one batch size cannot split the base cost from the batch's.
    assert latency(model=ready_model(batches=(16,))) is None
    # A flat fit (every batch size stepped in 97 ms: a busy machine) puts every step over a
    # 1 ms target, but fewer slots would not be faster: no blame, no capacity cut. The same
    # model with a cost per sequence blames the batch.
    assert latency(target=0.001, model=ready_model(beta=(0.097, 0, 0, 0))) is None
    assert latency(target=0.001, model=ready_model(beta=(0.097, 0.003, 0, 0))).kind == "lower"
    # Too few requests, or enough of them within the target.
    assert latency(w=replace(SLOW, tpot_buckets=within(0.5, 0.06, 10))) is None
    assert latency(w=replace(SLOW, tpot_buckets=within(0.95, 0.06, 100))) is None


def test_no_latency_lower_while_the_queue_grows_or_the_plant_is_degraded():
    assert latency(model=replace(ready_model(), queue=(1.0, 2.0, 3.0))) is None
    degraded = replace(ready_model(), degraded_until=1100.0, degraded_why="slower")
    assert latency(model=degraded, now=1000.0) is None
    assert latency(model=degraded, now=1100.0) is not None


def test_no_latency_lower_into_a_backlog():
    # A backlog (the oldest queued request past 1.5 x the 2 s TTFT target) would drain
    # slower, and its TTFTs are lost at any batch.
    assert latency(w=replace(SLOW, waiting=1.0, oldest_waiting_seconds=3.5)) is None
    # A young queue does not hold the lower: the queue guardrail raises no further than the
    # plan it leads to, and where clients give up before the TTFT target, the TPOTs of
    # the requests past the latency cap are what is lost.
    assert latency(w=replace(SLOW, waiting=1.0, oldest_waiting_seconds=1.0)).kind == "lower"


def test_no_latency_lower_while_a_queue_drains():
    # 10 queued on average over the window, 2 in the latest turn: the batch was the
    # backlog's, past what the demand keeps running, and so were its requests' TPOTs.
    young = replace(SLOW, waiting=10.0, oldest_waiting_seconds=1.0)
    assert latency(w=young, model=replace(ready_model(), queue=(20.0, 9.0, 2.0))) is None
    # A queue that holds as deep as the window's (clients that give up keep it young): lower.
    assert latency(w=young, model=replace(ready_model(), queue=(9.0, 11.0, 10.0))).kind == "lower"


def degraded_model(**kw) -> ModelState:
    """Ready, with a queue two turns long, on a plant whose steps became 4x the model's at
    900 s (frozen until 1,500 s)."""
    return replace(ready_model(), queue=(3.0, 3.0), degraded_until=1500.0, degraded_since=900.0,
                   degraded_why="step time above the model by +300%", degraded_gap=3.0, **kw)  # fmt: skip


def test_on_a_degraded_plant_one_queue_raise_makes_room_for_its_slower_steps():
    # Every slot of 8 busy on a machine 4x slower than the model: the plan and its reach
    # are the old machine's, so the raise is as many slots as keep the tokens a second,
    # 8 x 4, in one move rather than a doubling each turn.
    m, w = degraded_model(), busy(waiting=3)
    p = plan(m.fit(), m.demand, 0.1, Bounds(2, 64), 8, None, (None, None))
    got = guard.queue(w, {R0: w}, AT8, TUNE, m, p, LIMITS, 1000.0)
    assert (got.kind, got.settings.max_num_seqs) == ("raise", 32), got
    assert "PlantDegraded: steps 4.0x the model's" in got.reason
    # The KV cache is the same machine's: its cap still binds.
    got = guard.queue(w, {R0: w}, AT8, TUNE, m, replace(p, kv_cap=20), LIMITS, 1000.0)
    assert got.settings.max_num_seqs == 20
    # After the freeze, the plan again.
    assert guard.queue(w, {R0: w}, AT8, TUNE, m, p, LIMITS, 1500.0).settings.max_num_seqs == (
        p.max_num_seqs
    )


def test_a_degraded_plant_gets_one_queue_raise_for_the_whole_episode():
    at32 = EngineSettings(32)
    w = busy(running=32, max_num_seqs=32, waiting=3)
    raised = TuneDecision("guard", at32, "guardrail: queue", 950.0, "raise")
    state = TunerState(settings=at32, model=degraded_model(), history=(raised,))
    d, _ = decide(w, settings=at32, state=state)
    assert d.action == "hold" and "PlantDegraded" in d.reason, d.reason
    # A raise from before the episode does not count against it.
    before = replace(raised, time=800.0)
    d, _ = decide(w, settings=at32, state=replace(state, history=(before,)))
    assert (d.action, d.kind) == ("guard", "raise") and d.settings.max_num_seqs == 64


# --------------------------------------------------------------------------- the arbiter


def trial(kind: str, started=900.0) -> TunerState:
    e = Experiment(kind, AT8, EngineSettings(16), started, "why")
    first = TuneDecision("try", AT8, "why", started, kind)
    return TunerState(settings=AT8, experiment=e, history=(first,))


def queued(per_replica: float, replicas=2) -> Window:
    return window(replicas=replicas, running=8, waiting=per_replica)


UP = ScaleDecision(4, "scale up: a queue", 4)
DOWN = ScaleDecision(1, "scale down: idle", 1)
TARGET_QUEUE = 4.0


@pytest.mark.parametrize("kind", ["raise", "raise_budget", "fp8"])
def test_a_scale_up_waits_while_a_capacity_change_is_on_trial(kind):
    d = arbitrate(UP, 2, trial(kind), queued(10), TARGET_QUEUE, 1000.0)
    assert d.replicas == 2 and "tuning first" in d.reason and kind in d.reason
    # Unless the queue is an emergency.
    flood = queued(EMERGENCY_QUEUE_FACTOR * TARGET_QUEUE + 1)
    assert arbitrate(UP, 2, trial(kind), flood, TARGET_QUEUE, 1000.0) == UP


@pytest.mark.parametrize("kind", ["lower", "lower_budget", "fp8_off"])
def test_a_scale_up_goes_ahead_while_a_change_that_adds_no_capacity_is_on_trial(kind):
    assert arbitrate(UP, 2, trial(kind), queued(10), TARGET_QUEUE, 1000.0) == UP


def test_a_scale_down_is_frozen_during_any_trial_and_after_a_change():
    for kind in ("raise", "lower", "fp8_off"):
        d = arbitrate(DOWN, 2, trial(kind, started=0.0), queued(0), TARGET_QUEUE, 5000.0)
        assert d.replicas == 2 and "frozen" in d.reason
    last = 1000.0
    kept = TunerState(settings=AT8, history=(TuneDecision("keep", AT8, "kept", last, "lower"),))
    soon = last + ENGINE_CHANGE_FREEZE_SECONDS - 1
    assert arbitrate(DOWN, 2, kept, queued(0), TARGET_QUEUE, soon).replicas == 2
    late = last + ENGINE_CHANGE_FREEZE_SECONDS
    assert arbitrate(DOWN, 2, kept, queued(0), TARGET_QUEUE, late) == DOWN


def test_otherwise_the_autoscaler_decides():
    idle = TunerState(settings=AT8)
    for d in (UP, DOWN, ScaleDecision(2, "steady", 2)):
        assert arbitrate(d, 2, idle, queued(10), TARGET_QUEUE, 1000.0) == d
    # A scale-up during a trial that adds no capacity, and a steady count during any trial.
    steady = ScaleDecision(2, "steady", 2)
    assert arbitrate(steady, 2, trial("raise"), queued(10), TARGET_QUEUE, 1000.0) == steady


def test_the_loop_is_blind_under_half_the_replicas_answering():
    failures = {f"http://r{i}": "timeout" for i in range(1, 4)}
    why = blindness(4, RoundResult(scraped=1, failures=failures))
    assert why is not None and "1 of 4" in why and "http://r3: timeout" in why
    assert blindness(4, RoundResult(scraped=2, failures=dict(list(failures.items())[:2]))) is None
    assert blindness(0, RoundResult()) is None
    assert blindness(1, RoundResult(scraped=0, failures={"http://r0": "refused"})) is not None


# --------------------------------------------------------------------------- properties

BOUNDED = parse_spec(
    {
        "engine": {"maxNumSeqs": 8},
        "slo": {"interTokenLatencySeconds": 0.1, "timeToFirstTokenSeconds": 2.0},
        "tuning": {
            "enabled": True,
            "maxNumSeqs": {"min": 2, "max": 64},
            "maxNumBatchedTokens": {"min": 64, "max": 4096},
        },
    }
)


replica_windows = st.builds(
    lambda running, waiting, kv, peak, preemptions, tokens, share, n, oldest, cells: Window(
        replicas=1,
        span_seconds=60.0,
        waiting=waiting,
        running=running,
        swapped=0.0,
        kv_cache_usage=kv,
        kv_cache_usage_peak=max(kv, peak),
        preemptions_per_minute=preemptions,
        swaps_per_minute=0.0,
        generation_tokens_per_second=tokens,
        waiting_now=waiting,
        running_now=running,
        ttft_buckets=within(share, 2.0, n),
        tpot_buckets=within(share, 0.1, n),
        requests_finished=n,
        prompt_tokens_sum=200.0 * n,
        output_tokens_sum=100.0 * n,
        arrivals_per_second=n / 60,
        oldest_waiting_seconds=oldest,
        steps=step_cells(cells) if cells else (),
    ),
    running=st.floats(0, 80),
    waiting=st.floats(0, 50),
    kv=st.floats(0, 1),
    peak=st.floats(0, 1),
    preemptions=st.floats(0, 30),
    tokens=st.floats(0, 5000),
    share=st.floats(0, 1),
    n=st.sampled_from([0.0, 10.0, 100.0, 1000.0]),
    oldest=st.floats(0, 10),
    cells=st.sampled_from([(), (8,), (1, 4, 16), (8, 32, 64)]),
)


@st.composite
def engine_settings(draw):
    mns = draw(st.integers(2, 64))
    budget = draw(st.one_of(st.none(), st.integers(max(64, mns), 4096)))
    return EngineSettings(mns, draw(st.sampled_from(["auto", "fp8"])), budget)


@st.composite
def models(draw):
    """Nothing learnt, or a ready model, with a recent queue and maybe a degraded plant."""
    m = draw(st.sampled_from([ModelState(), ready_model(), ready_model(batches=(8,))]))
    queue = tuple(draw(st.lists(st.floats(0, 50), max_size=3)))
    degraded = draw(st.sampled_from([None, 1100.0]))
    return replace(m, queue=queue, degraded_until=degraded)


def _in_bounds(s: EngineSettings, spec) -> None:
    t = spec.tuning
    assert t.max_num_seqs.min <= s.max_num_seqs <= t.max_num_seqs.max
    assert s.kv_cache_dtype in ("auto", "fp8")
    if s.max_num_batched_tokens is not None:
        assert t.max_num_batched_tokens.min <= s.max_num_batched_tokens
        assert s.max_num_batched_tokens <= t.max_num_batched_tokens.max


@settings(max_examples=300, deadline=None)
@given(
    start=engine_settings(),
    fp8=st.booleans(),
    model=models(),
    first=st.lists(replica_windows, min_size=1, max_size=3),
    second=st.lists(replica_windows, min_size=1, max_size=3),
)
def test_every_decision_stays_in_bounds_and_moves_only_the_safe_way(
    start, fp8, model, first, second
):
    spec = BOUNDED.model_copy(
        update={"tuning": BOUNDED.tuning.model_copy(update={"allow_fp8_kv_cache": fp8})}
    )

    def view(ws):  # the replicas report nothing: "unknown" counts as running the change
        reps = {f"http://r{i}": w for i, w in enumerate(ws)}
        service = merge_windows(ws)
        return View(service=service, replicas=reps, latest=service)

    state = TunerState(settings=start, model=model)
    d, st1 = decide_tuning(view(first), spec, state, start, 1000.0)
    _in_bounds(d.settings, spec)
    mns, new = start.max_num_seqs, d.settings.max_num_seqs
    e = st1.experiment
    if d.action == "hold":
        assert d.settings == start and e is None
        return
    # Only a planned change moves the budget; a move changes one thing.
    if d.kind not in ("raise_budget", "lower_budget"):
        assert d.settings.max_num_batched_tokens == start.max_num_batched_tokens
    if d.action == "guard":
        assert e is None and st1.settings == d.settings
        if d.kind == "raise":
            assert new > mns and d.settings.kv_cache_dtype == start.kv_cache_dtype
            if start.max_num_batched_tokens is not None:
                assert new <= start.max_num_batched_tokens
        elif d.kind == "lower":
            assert max(2, math.ceil(mns / 2)) <= new < mns
        else:
            assert (d.kind, new) == ("fp8", mns) and fp8
        return
    # A planned change: on trial, never while the plant is degraded; or a thrash lower,
    # tested at once whatever the freezes.
    assert d.action in ("try", "canary") and e is not None
    if "KV thrash" not in d.reason:
        assert not st1.model.degraded(1000.0) and not st1.model.queue_growing()
    _in_bounds(e.after, spec)
    assert e.kind in ("raise", "lower", "fp8_off", "raise_budget", "lower_budget")
    # The verdict (or a wait for one) stays in bounds too, and goes back to ``start`` or on
    # to the trial's settings; or a queue or thrash guardrail that will not wait ends the
    # test and moves, in its safe direction.
    d2, st2 = decide_tuning(view(second), spec, st1, start, 1060.0)
    _in_bounds(d2.settings, spec)
    if d2.action == "guard":
        assert st2.experiment is None and "was abandoned" in d2.reason
        return
    assert d2.settings in (start, e.after)
    if d2.action in ("revert", "abandon"):
        assert st2.settings == start
    if d2.action in ("keep", "rollout"):
        assert st2.settings == e.after
