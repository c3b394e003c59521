"""The pure control laws, decision by decision: autoscale.decide_replicas (capacity per
engine settings), tune.decide_tuning's rules (which change it proposes), the arbiter
between them (loop.arbitrate, loop.blindness), plus properties over random windows.
The experiment flows (canary, keep, revert, back-off) are in test_tuner_experiments.py."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.operator.crd.autoscaling import AutoscalingSpec
from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.autoscale import (
    Recommendation,
    ScaleDecision,
    ScaleHistory,
    decide_replicas,
)
from batchpilot.operator.loop.observe import RoundResult, Window, merge_windows
from batchpilot.operator.loop.state import TunerState
from batchpilot.operator.loop.tune import View, decide_tuning
from batchpilot.operator.loop.tune_rules import thrash_per_1k
from batchpilot.operator.loop.tuner_state import EngineSettings, Experiment, TuneDecision
from batchpilot.operator.loop.turn import (
    EMERGENCY_QUEUE_FACTOR,
    ENGINE_CHANGE_FREEZE_SECONDS,
    arbitrate,
    blindness,
)
from tests.support.loop import tw, window

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
    w, current: int, ticks: int, interval=10.0, spec=SCALE, start=0.0, history=None, settings=""
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


AT8_KEY = EngineSettings(8).key
AT32_KEY = EngineSettings(32).key


def test_measured_capacity_blocks_a_scale_down_that_could_not_carry_the_load():
    # Four replicas, little queued, but the service generates 600 tokens/s and one replica
    # was measured sustaining 250 under these settings: two replicas would be at 300 each,
    # over 90% of 250.
    busy = window(replicas=4, running=6, waiting=0, tokens=150, max_num_seqs=32)
    history = ScaleHistory((), ((AT32_KEY, 250.0),))
    counts = run_scaler(busy, 4, ticks=60, history=history, settings=AT32_KEY)
    assert min(counts) == 3  # ceil(600 / 225)


def test_a_capacity_measured_under_other_settings_does_not_block_a_scale_down():
    busy = window(replicas=4, running=6, waiting=0, tokens=150, max_num_seqs=32)
    history = ScaleHistory((), ((AT8_KEY, 250.0),))  # measured at max_num_seqs 8
    counts = run_scaler(busy, 4, ticks=60, history=history, settings=AT32_KEY)
    assert min(counts) == 1  # by slots alone: 24 in the system, 36 per replica
    # ... and the figure under the other settings is kept, not overwritten.
    d = decide_replicas(busy, SCALE, 4, 0.0, history, AT32_KEY)
    assert d.history.capacity(AT8_KEY) == 250.0 and d.history.capacity(AT32_KEY) is None


def test_capacity_is_measured_only_while_saturated_and_per_settings():
    saturated = window(running=8, waiting=5, tokens=200)
    d = decide_replicas(saturated, SCALE, 1, 0.0, settings=AT8_KEY)
    assert d.history.capacity(AT8_KEY) == 200 and d.history.capacity(AT32_KEY) is None
    calm = window(running=3, waiting=0, tokens=50)
    assert (
        decide_replicas(calm, SCALE, 1, 10.0, d.history, AT8_KEY).history.capacity(AT8_KEY) == 200
    )
    # Saturated under other settings: a second figure, the first one kept.
    d2 = decide_replicas(
        window(running=32, waiting=5, tokens=500, max_num_seqs=32),
        SCALE,
        1,
        20.0,
        d.history,
        AT32_KEY,
    )
    assert d2.history.capacity(AT8_KEY) == 200 and d2.history.capacity(AT32_KEY) == 500


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


# --------------------------------------------------------------------------- tune: rules

TUNE = parse_spec(
    {
        "engine": {"maxNumSeqs": 8},
        "slo": {"interTokenLatencySeconds": 0.1},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 2, "max": 64}, "cooldownSeconds": 120},
    }
)
TUNE_FP8 = TUNE.model_copy(
    update={"tuning": TUNE.tuning.model_copy(update={"allow_fp8_kv_cache": True})}
)
AT8 = EngineSettings(8, "auto")


def one(url: str, **kw) -> Window:
    """One replica's window, reported under ``url``."""
    w = tw(replicas=1, **kw)
    return replace(
        w,
        max_num_seqs=dict.fromkeys([url], *w.max_num_seqs.values()),
        max_num_batched_tokens=dict(zip([url], w.max_num_batched_tokens.values(), strict=False)),
        kv_cache_dtype=dict.fromkeys([url], *w.kv_cache_dtype.values()),
    )


def propose(w: Window, spec=TUNE, settings=AT8, now=1000.0):
    """The first decision of a tuner that has decided nothing yet, on one replica's window."""
    v = View(service=w, replicas={"http://r0": w})
    return decide_tuning(v, spec, TunerState(settings=settings), settings, now)


def proposed(w: Window, spec=TUNE, settings=AT8) -> tuple[str, EngineSettings]:
    """(kind, settings tried), or ("hold", the settings in force)."""
    d, st = propose(w, spec, settings)
    if st.experiment is None:
        return "hold", d.settings
    return st.experiment.kind, st.experiment.after


def test_slot_bound_raises_at_most_double():
    d, st = propose(tw(running=8, waiting=5, kv=0.1, tokens=100))
    assert (st.experiment.kind, st.experiment.after) == ("raise", EngineSettings(16))
    assert d.inputs["waitingPerReplica"] == 5 and d.inputs["maxNumSeqs"] == 8


def test_a_raise_stops_where_the_kv_peak_would_pass_its_bound():
    busy = tw(running=8, waiting=5, kv=0.3, kv_peak=0.6, tokens=100)
    assert proposed(busy) == ("raise", EngineSettings(math.floor(8 * 0.85 / 0.6)))  # 11, not 16


def test_a_raise_respects_the_spec_maximum_and_the_step_budget():
    busy = tw(running=60, waiting=5, kv=0.1, tokens=100, max_num_seqs=60)
    assert proposed(busy, settings=EngineSettings(60)) == ("raise", EngineSettings(64))
    # A step holds one token of every running sequence: no more sequences than the budget.
    capped = EngineSettings(8, "auto", 12)
    busy = tw(running=8, waiting=5, kv=0.1, tokens=100, budget=12)
    assert proposed(busy, settings=capped) == ("raise", EngineSettings(12, "auto", 12))


def test_no_raise_without_a_queue_or_with_preemption_and_the_latency_rule_goes_first():
    assert proposed(tw(running=8, waiting=0, tokens=100))[0] == "hold"
    assert proposed(tw(running=4, waiting=5, tokens=100))[0] == "hold"
    # Preempting at all (here 0.5 per 1,000 tokens, under the memory bound) blocks a raise.
    assert proposed(tw(running=8, waiting=5, preemptions=3, tokens=100))[0] == "hold"
    # Near the ITL target a raise is still a hypothesis worth a trial (its verdict decides).
    assert proposed(tw(running=8, waiting=5, itl_p99=0.09, tokens=100))[0] == "raise"
    # Over it, the latency rule's lower is tried first.
    assert proposed(tw(running=8, waiting=5, itl_p99=0.12, tokens=100))[0] == "lower"


def test_thrash_lowers_below_the_batch_that_runs():
    thrash = tw(running=12, waiting=10, preemptions=20, kv=0.95, tokens=50, max_num_seqs=64)
    _d, st = propose(thrash, settings=EngineSettings(64))
    assert (st.experiment.kind, st.experiment.after) == ("lower", EngineSettings(9))  # 0.75 x 12
    assert "memory-bound" in st.experiment.reason


def test_thrash_while_the_old_batch_drains_under_a_new_limit_holds():
    draining = tw(running=5, preemptions=20, tokens=50, max_num_seqs=3)  # five finishing
    assert proposed(draining, settings=EngineSettings(3)) == ("hold", EngineSettings(3))


def test_thrash_prefers_fp8_when_allowed_and_lowers_once_fp8_is_on():
    thrash = tw(running=12, preemptions=20, tokens=50, max_num_seqs=64)
    assert proposed(thrash, TUNE_FP8, EngineSettings(64)) == ("fp8", EngineSettings(64, "fp8"))
    on = tw(running=12, preemptions=20, tokens=50, max_num_seqs=64, dtype="fp8")
    assert proposed(on, TUNE_FP8, EngineSettings(64, "fp8")) == ("lower", EngineSettings(9, "fp8"))


def test_latency_over_target_lowers():
    assert proposed(tw(running=8, itl_p99=0.2, tokens=100)) == ("lower", EngineSettings(6))


def test_a_window_with_too_few_gaps_holds():
    few = tw(running=8, waiting=0, itl_p99=0.2, tokens=100)
    few = replace(few, itl_buckets=tuple((le, n / 10) for le, n in few.itl_buckets))
    d, st = propose(few)
    assert d.action == "hold" and "too little traffic" in d.reason and st.experiment is None


def test_kv_full_with_a_queue_switches_to_fp8_only_when_allowed():
    full = tw(running=6, waiting=5, kv=0.97, tokens=100)
    assert proposed(full)[0] == "hold"
    assert proposed(full, TUNE_FP8) == ("fp8", EngineSettings(8, "fp8"))


def test_the_minimum_bound_holds():
    low = tw(running=2, preemptions=30, tokens=50, max_num_seqs=2)
    assert proposed(low, settings=EngineSettings(2)) == ("hold", EngineSettings(2))


def test_thrash_is_per_thousand_tokens_so_it_carries_over_to_gpus():
    # 30 preemptions a minute: 5 per 1,000 tokens at 100 tokens/s (a CPU), memory-bound;
    # 0.1 per 1,000 at 5,000 tokens/s (a GPU), not.
    cpu = tw(running=6, preemptions=30, tokens=100)
    gpu = tw(running=6, preemptions=30, tokens=5000)
    assert thrash_per_1k(cpu) == pytest.approx(5.0) and thrash_per_1k(gpu) == pytest.approx(0.1)
    assert proposed(cpu) == ("lower", EngineSettings(4))
    assert proposed(gpu)[0] == "hold"
    assert thrash_per_1k(tw(preemptions=1, tokens=0)) == math.inf
    assert thrash_per_1k(tw(tokens=0)) == 0.0


def test_an_itl_outlier_is_reported_not_averaged():
    reps = {
        f"http://r{i}": one(f"http://r{i}", running=4, itl_p99=0.03, tokens=100) for i in range(4)
    }
    reps["http://r2"] = one("http://r2", running=4, itl_p99=0.07, tokens=100)
    v = View(service=merge_windows(list(reps.values())), replicas=reps)
    d, _ = decide_tuning(v, TUNE, TunerState(), AT8, 1000.0)
    assert d.inputs["outlierReplicas"] == ["http://r2"]
    assert d.inputs["itlP99SecondsWorstReplica"] == pytest.approx(0.07)


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
            "cooldownSeconds": 0,
        },
    }
)


def _hist(p99, n):
    return () if p99 is None or n == 0 else ((0.0, 0.0), (p99 / 0.99, n), (math.inf, n))


replica_windows = st.builds(
    lambda running, waiting, kv, peak, preemptions, tokens, itl, ttft, n: Window(
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
        ttft_buckets=_hist(ttft, n),
        itl_buckets=_hist(itl, n),
    ),
    running=st.floats(0, 80),
    waiting=st.floats(0, 50),
    kv=st.floats(0, 1),
    peak=st.floats(0, 1),
    preemptions=st.floats(0, 30),
    tokens=st.floats(0, 5000),
    itl=st.one_of(st.none(), st.floats(0.001, 1)),
    ttft=st.one_of(st.none(), st.floats(0.01, 10)),
    n=st.sampled_from([0.0, 100.0, 1000.0, 5000.0]),
)


@st.composite
def engine_settings(draw):
    mns = draw(st.integers(2, 64))
    budget = draw(st.one_of(st.none(), st.integers(max(64, mns), 4096)))
    return EngineSettings(mns, draw(st.sampled_from(["auto", "fp8"])), budget)


def _in_bounds(s: EngineSettings, spec) -> None:
    t = spec.tuning
    assert t.max_num_seqs.min <= s.max_num_seqs <= t.max_num_seqs.max
    assert s.kv_cache_dtype in ("auto", "fp8")
    if s.max_num_batched_tokens is not None:
        assert t.max_num_batched_tokens.min <= s.max_num_batched_tokens
        assert s.max_num_batched_tokens <= t.max_num_batched_tokens.max
        assert s.max_num_batched_tokens >= s.max_num_seqs


@settings(max_examples=300, deadline=None)
@given(
    start=engine_settings(),
    fp8=st.booleans(),
    first=st.lists(replica_windows, min_size=1, max_size=3),
    second=st.lists(replica_windows, min_size=1, max_size=3),
)
def test_every_decision_stays_in_bounds_with_a_bounded_step(start, fp8, first, second):
    spec = BOUNDED.model_copy(
        update={"tuning": BOUNDED.tuning.model_copy(update={"allow_fp8_kv_cache": fp8})}
    )

    def view(ws):  # the replicas report nothing: "unknown" counts as running the change
        reps = {f"http://r{i}": w for i, w in enumerate(ws)}
        return View(service=merge_windows(ws), replicas=reps)

    d, st1 = decide_tuning(view(first), spec, TunerState(), start, 1000.0)
    _in_bounds(d.settings, spec)
    e = st1.experiment
    if e is None:
        assert d.settings == start and d.action == "hold"
        return
    _in_bounds(e.after, spec)
    mns, new = start.max_num_seqs, e.after.max_num_seqs
    assert new <= 2 * mns
    if e.kind == "lower":
        running = merge_windows(first).per_replica(merge_windows(first).running)
        assert max(2, math.floor(0.75 * min(mns, running))) <= new < mns
    if e.kind in ("raise_budget", "lower_budget"):
        old, budget = start.max_num_batched_tokens, e.after.max_num_batched_tokens
        assert old / 2 - 1 <= budget <= 2 * old and new == mns
    if e.kind in ("fp8", "fp8_off"):
        assert fp8 or e.kind == "fp8_off"
        assert (new, e.after.max_num_batched_tokens) == (mns, start.max_num_batched_tokens)
    # The verdict (or a wait for one) stays in bounds too, and goes back to ``start`` or on
    # to the trial's settings.
    d2, st2 = decide_tuning(view(second), spec, st1, start, 1060.0)
    _in_bounds(d2.settings, spec)
    assert d2.settings in (start, e.after)
    if d2.action in ("revert", "abandon"):
        assert st2.settings == start
    if d2.action in ("keep", "rollout"):
        assert st2.settings == e.after
