"""The tuner's planned changes (tune.decide_tuning, loop v3): when the model's plan moves
max_num_seqs (or takes fp8 back off), the change runs on one replica chosen at random
against the others, or on the only one against its own baseline, under the sequential
no-harm test (verify.py); it is kept (rolled out), reverted or abandoned. A failed test
forbids the move until the model's epoch changes; planned changes wait out a dwell, at
most ``planned_per_hour`` an hour, and freeze while the plant is degraded, the queue grows
or a rollout is under way. Windows and models are built by hand (tests/support/loop.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop import verify
from batchpilot.operator.loop.guardrails import TuneLimits
from batchpilot.operator.loop.model_state import ModelState
from batchpilot.operator.loop.observe import Window, merge_windows
from batchpilot.operator.loop.state import TunerState
from batchpilot.operator.loop.tune import View, decide_tuning
from batchpilot.operator.loop.tuner_state import EngineSettings, Experiment, Move, TuneDecision
from batchpilot.operator.loop.turn import live_targets
from tests.support.loop import DEMAND, ready_model, replica, replicas

R0, R1, R2, R3 = (f"http://r{i}" for i in range(4))
AT8 = EngineSettings(8, "auto")
PLANNED = EngineSettings(26)  # the plan of ready() against a 100 ms TPOT target
LIMITS = TuneLimits()
SPEC = parse_spec(
    {
        "engine": {"maxNumSeqs": 8},
        "slo": {"interTokenLatencySeconds": 0.1, "timeToFirstTokenSeconds": 2.0},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 2, "max": 64}},
    }
)
FP8_SPEC = SPEC.model_copy(
    update={"tuning": SPEC.tuning.model_copy(update={"allow_fp8_kv_cache": True})}
)


def view(reps: dict[str, Window], latest: Window | None = None) -> View:
    return View(
        service=merge_windows(list(reps.values())),
        replicas=reps,
        latest=latest,
        latest_replicas=reps,
    )


def turn(reps, state: TunerState, now=1000.0, spec=SPEC, in_force=AT8):
    """One turn; the model learns nothing new (its state is the test's)."""
    return decide_tuning(view(reps), spec, state, in_force, now)


# 2 requests/s per replica: 8 slots bind (the twin predicts 149 tokens/s at 8, 176 at 26),
# so the plan's raise pays and is made.
BUSY = replace(DEMAND, rate=2.0)


def ready(settings=AT8, **kw) -> TunerState:
    return TunerState(settings=settings, model=replace(ready_model(demand=BUSY), **kw))


def quiet(n: int, **kw) -> dict[str, Window]:
    """``n`` replicas with free slots (6 of 8 running), no queue, every request in time."""
    return replicas(n, running=6, **kw)


def started(n=2, now=1000.0):
    return turn(quiet(n), ready(), now=now)


def canary_result(e: Experiment, share=1.0, finished=200.0, n=2) -> dict[str, Window]:
    """The canary runs the change, the others what is in force; ``share`` of the canary's
    requests met the TPOT target, all of the others'."""
    out = {}
    for i in range(n):
        url = f"http://r{i}"
        on = url == e.canary
        s = e.after if on else e.before
        out[url] = replica(url, running=6, max_num_seqs=s.max_num_seqs, finished=finished,
                           tpot_share=share if on else 1.0)  # fmt: skip
    return out


# --------------------------------------------------------------------------- canary


def test_a_planned_change_on_two_or_more_replicas_runs_on_one_first():
    d, st = started()
    assert (d.action, d.kind) == ("canary", "raise")
    assert (
        d.reason.startswith("testing on http://r") and "planned: max_num_seqs 8 -> 26" in d.reason
    )
    assert d.settings == AT8 and st.settings == AT8  # in force everywhere else: unchanged
    e = st.experiment
    assert e is not None and e.canary in (R0, R1) and e.baseline is None
    assert (e.before, e.after, e.started, e.epoch) == (AT8, PLANNED, 1000.0, 0)
    assert st.history[-1].action == "canary" and st.history[-1].kind == "raise"
    other = R1 if e.canary == R0 else R0
    assert live_targets(st, [R0, R1]) == {e.canary: PLANNED, other: AT8}
    assert st.model.planned == (1000.0,) and st.planned_epoch == 0


def test_the_canary_is_chosen_at_random():
    canaries = {started(n=4, now=1000.0 + i)[1].experiment.canary for i in range(20)}
    assert len(canaries) >= 2 and canaries <= {R0, R1, R2, R3}
    # The same turn picks the same one (a decision is a function of its inputs).
    assert started(n=4, now=1234.0)[1].experiment == started(n=4, now=1234.0)[1].experiment


def test_a_canary_is_judged_only_after_the_minimum_time_and_requests():
    _, st = started()
    e = st.experiment
    d, st2 = turn(canary_result(e), st, now=1000 + verify.MIN_SECONDS / 2)
    assert d.action == "hold" and "observing" in d.reason
    # The test goes on, and has counted the requests of the turn.
    assert replace(st2.experiment, trial=e.trial, control=e.control) == e
    assert st2.experiment.trial.requests > 0 and st2.experiment.control.requests > 0
    d, st2 = turn(canary_result(e, finished=5), st, now=1060)
    assert d.action == "hold" and replace(st2.experiment, trial=e.trial, control=e.control) == e


def test_a_canary_no_worse_than_the_others_is_rolled_out():
    _, st = started()
    d, st = turn(canary_result(st.experiment), st, now=1060)
    assert (d.action, d.kind) == ("rollout", "raise") and "no worse" in d.reason
    assert d.settings == PLANNED and st.settings == PLANNED and st.experiment is None
    assert d.before.attainment == d.after.attainment == 1.0
    (v,) = st.verdicts
    assert v.settings == Move(AT8, "raise").key and v.kept and v.epoch == 0
    assert live_targets(st, [R0, R1]) == {R0: PLANNED, R1: PLANNED}


def test_a_worse_canary_is_reverted_and_its_move_blocked_until_the_model_changes():
    _, st = started()
    d, st = turn(canary_result(st.experiment, share=0.5), st, now=1060)
    assert (d.action, d.kind) == ("revert", "raise") and "worse" in d.reason
    assert d.settings == AT8 and st.settings == AT8 and st.experiment is None
    (v,) = st.verdicts
    assert (v.settings, v.kept, v.epoch) == (Move(AT8, "raise").key, False, 0)
    # Under the same model nothing is re-planned, not even after the drift check is due.
    d, st = turn(quiet(2), st, now=1100)
    assert d.action == "hold" and "nothing changed" in d.reason
    late = 1060 + LIMITS.replan_seconds
    d, st = turn(quiet(2), st, now=late)
    assert d.action == "hold" and "failed its test under this model" in d.reason
    assert st.experiment is None
    # A change point starts a new epoch: the model may propose it again.
    st = replace(st, model=replace(st.model, epoch=1))
    d, st = turn(quiet(2), st, now=late + 15)
    assert (d.action, d.kind) == ("canary", "raise") and st.experiment.epoch == 1


def test_a_canary_whose_steps_run_slower_at_matched_batch_is_reverted():
    from tests.support.loop import step_cells

    _, st = started()
    e = st.experiment
    reps = canary_result(e)
    reps = {u: replace(w, steps=step_cells(scale=1.5 if u == e.canary else 1.0))
            for u, w in reps.items()}  # fmt: skip
    d, _ = turn(reps, st, now=1060)
    assert d.action == "revert" and "step time at matched batch sizes 1.50x" in d.reason


def test_a_canary_that_stops_answering_or_did_not_take_the_change_is_abandoned():
    _, st = started()
    e = st.experiment
    other = R1 if e.canary == R0 else R0
    d, st2 = turn({other: replica(other, running=6)}, st, now=1060)
    assert (d.action, d.kind) == ("abandon", "raise") and "stopped answering" in d.reason
    assert d.settings == AT8 and st2.settings == AT8 and st2.experiment is None
    assert st2.verdicts == ()  # nothing was learnt
    # Its apply failed: it still runs 8.
    d, st3 = turn(quiet(2), st, now=1060)
    assert d.action == "abandon" and "apply failed" in d.reason and st3.verdicts == ()


# --------------------------------------------------------------------------- one replica


def test_one_replica_tries_the_change_against_its_own_baseline():
    d, st = started(n=1)
    assert (d.action, d.kind) == ("try", "raise")
    assert d.settings == PLANNED and st.settings == PLANNED
    e = st.experiment
    assert e.canary is None and e.baseline is not None and e.baseline.attainment == 1.0
    after = {R0: replica(R0, running=6, max_num_seqs=26, finished=200)}
    d, kept = turn(after, st, now=1060, in_force=PLANNED)
    assert d.action == "keep" and kept.settings == PLANNED and kept.verdicts[0].kept
    worse = {R0: replica(R0, running=6, max_num_seqs=26, finished=200, tpot_share=0.4)}
    d, reverted = turn(worse, st, now=1060, in_force=PLANNED)
    assert d.action == "revert" and reverted.settings == AT8


def test_a_trial_no_replica_runs_waits_and_is_abandoned_at_the_limit():
    _, st = started(n=1)
    old = {R0: replica(R0, running=6, max_num_seqs=8)}  # the change has not reached it
    d, st2 = turn(old, st, now=1060, in_force=PLANNED)
    assert d.action == "hold" and "no replica runs it yet" in d.reason
    assert st2.experiment == st.experiment
    d, st2 = turn(old, st, now=1001 + verify.MAX_SECONDS, in_force=PLANNED)
    assert d.action == "abandon" and st2.settings == AT8 and st2.verdicts == ()


def test_an_undecided_trial_fails_at_the_limit():
    _, st = started(n=1)
    few = {R0: replica(R0, running=6, max_num_seqs=26, finished=5)}
    d, _ = turn(few, st, now=1060, in_force=PLANNED)
    assert d.action == "hold"
    d, st2 = turn(few, st, now=1000 + verify.MAX_SECONDS, in_force=PLANNED)
    assert d.action == "revert" and "too few requests" in d.reason
    assert st2.blocked(Move(AT8, "raise"), 0) is not None


# --------------------------------------------------------------------------- when to plan


def test_without_a_ready_model_or_enough_window_the_tuner_holds():
    d, st = turn(quiet(1), TunerState(settings=AT8))
    assert d.action == "hold" and d.reason.startswith("learning:") and st.experiment is None
    d, _ = turn(quiet(1, span=10.0), ready())
    assert d.action == "hold" and "observing" in d.reason
    d, _ = decide_tuning(View(None, {}), SPEC, ready(), AT8, 1000.0)
    assert d.action == "hold" and d.reason == "no metrics"
    assert st.history == ()  # holds are not history


def test_a_planned_raise_is_made_only_where_the_twin_predicts_it_pays():
    # At 1 request/s per replica, 6 of 8 slots busy: the plan (27 at this demand) is far past
    # today's, but the twin predicts the same goodput at both, so there is nothing to test.
    idle = TunerState(settings=AT8, model=ready_model())
    d, st = turn(quiet(2), idle)
    assert (d.action, d.settings) == ("hold", AT8), d.reason
    assert d.reason.endswith("no raise to 27: twin goodput 84.9 tokens/s at 8, 84.9 at 27")
    assert st.experiment is None and st.planned_epoch == 0  # planned: not due again at once


def test_a_plan_with_no_move_holds_until_something_changes():
    near = ready(settings=EngineSettings(24))  # the plan (26) is within the hysteresis
    reps = quiet(2, max_num_seqs=24)
    d, st = turn(reps, near, in_force=EngineSettings(24))
    assert d.action == "hold" and d.reason.startswith("planned, no move:")
    assert st.planned_epoch == 0
    d, _ = turn(reps, st, now=1015.0, in_force=EngineSettings(24))
    assert d.action == "hold" and d.reason.startswith("holding, nothing changed:")


def test_no_planned_change_within_the_dwell_after_any_change():
    last = TuneDecision("guard", AT8, "guardrail: queue", 1000.0 - 300, "raise")
    st = replace(ready(), history=(last,))
    d, st2 = turn(quiet(2), st)
    assert d.action == "hold" and "dwell: 300 s left" in d.reason and st2.experiment is None
    d, _ = turn(quiet(2), st, now=1000.0 - 300 + LIMITS.dwell_seconds)
    assert d.action == "canary"


def test_the_dwell_does_not_hold_a_planned_raise_the_autoscaler_pays_for():
    """Three replicas where the plan's capacity needs fewer: the raise is tested now, not
    after the dwell. Without autoscaling, or on the one replica, it waits."""
    last = TuneDecision("guard", AT8, "guardrail: queue", 1000.0 - 300, "raise")
    st = replace(ready(), history=(last,))
    scaled = SPEC.model_copy(
        update={"autoscaling": SPEC.autoscaling.model_copy(update={"enabled": True})}
    )
    d, st2 = turn(quiet(3), st, spec=scaled)
    assert d.action == "canary" and st2.experiment.after == PLANNED, d.reason
    assert "dwell" in turn(quiet(3), st)[0].reason
    assert "dwell" in turn(quiet(1), st, spec=scaled)[0].reason  # one replica is the least


def test_at_most_the_planned_changes_an_hour():
    st = ready(planned=(1000.0 - 3000, 1000.0 - 1000))
    d, _ = turn(quiet(2), st)
    assert d.action == "hold" and "2 planned changes in the last hour" in d.reason
    d, _ = turn(quiet(2), st, now=1000.0 + 601)  # the older one is over an hour ago
    assert d.action == "canary"
    assert ready().model.with_planned(5000.0).planned == (5000.0,)


def test_a_degraded_plant_a_growing_queue_or_a_rollout_freezes_planned_changes():
    d, _ = turn(quiet(2), ready(degraded_until=1100.0, degraded_why="step time above"))
    assert d.action == "hold" and "PlantDegraded (step time above)" in d.reason
    assert turn(quiet(2), ready(degraded_until=1100.0), now=1100.0)[0].action == "canary"
    d, _ = turn(quiet(2), ready(queue=(1.0, 2.0, 3.0)))
    assert d.action == "hold" and "the queue is growing" in d.reason
    mixed = {
        R0: replica(R0, running=6, max_num_seqs=8),
        R1: replica(R1, running=6, max_num_seqs=16),
    }
    d, _ = turn(mixed, ready())
    assert d.action == "hold" and "a rollout" in d.reason


def test_a_degraded_plant_still_lets_a_queue_guardrail_raise():
    st = ready(degraded_until=2000.0, queue=(3.0, 3.0))
    w = replica(R0, running=8, waiting=3, kv=0.1)
    d, _ = turn({R0: w}, st)
    assert (d.action, d.kind, d.settings) == ("guard", "raise", PLANNED)


def test_a_capacity_cut_under_test_is_reverted_when_the_queue_grows():
    s16 = EngineSettings(16)
    e = Experiment("lower", s16, AT8, 900.0, "planned", None, R0, 0)
    growing = TunerState(settings=s16, experiment=e, model=replace(ready_model(), queue=(1.0, 2.0, 3.0)))  # fmt: skip
    reps = {R0: replica(R0, max_num_seqs=8), R1: replica(R1, max_num_seqs=16)}
    d, st = turn(reps, growing, in_force=s16)
    assert (d.action, d.kind) == ("revert", "lower") and "queue grew" in d.reason
    assert st.settings == s16 and st.blocked(Move(s16, "lower"), 0) is not None
    # A raise under test is not cut short by the queue it may be draining.
    raise_ = replace(growing, experiment=replace(e, kind="raise", before=AT8, after=s16), settings=AT8)  # fmt: skip
    d, _ = turn({R0: replica(R0, max_num_seqs=16), R1: replica(R1)}, raise_, now=930.0)
    assert d.action == "hold"


# --------------------------------------------------------------------------- fp8 back off


def test_fp8_goes_back_off_as_a_planned_change_on_every_replica_when_16_bits_would_fit():
    fp8 = EngineSettings(8, "fp8")
    st = replace(ready(), settings=fp8)
    reps = quiet(2, dtype="fp8", kv=0.1, kv_peak=0.2)
    d, st = turn(reps, st, spec=FP8_SPEC, in_force=fp8)
    # The dtype restarts pods: no canary, the baseline is the window before.
    assert (d.action, d.kind, d.settings) == ("try", "fp8_off", AT8)
    assert st.experiment.canary is None and st.experiment.baseline is not None
    # r0 restarted in 16 bits and does well; r1, still fp8, badly: only r0 is evidence.
    mixed = {
        R0: replica(R0, running=6, dtype="auto", finished=200),
        R1: replica(R1, running=6, dtype="fp8", finished=200, tpot_share=0.2),
    }
    d, st2 = turn(mixed, st, now=1060, spec=FP8_SPEC)
    assert d.action == "keep" and st2.settings == AT8 and d.after.attainment == 1.0
    # A full cache or a queue keeps fp8.
    full = quiet(2, dtype="fp8", kv=0.3, kv_peak=0.6)
    d, _ = turn(full, replace(ready(), settings=fp8), spec=FP8_SPEC, in_force=fp8)
    assert d.kind != "fp8_off"


# --------------------------------------------------------------------------- no ratchet


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_noisy_neighbour_never_walks_max_num_seqs_down(n):
    """Half the requests miss the TPOT target at every setting (a neighbour), but the model
    puts a step at the running batch far under it: no guardrail lowers, no plan lowers."""
    urls = [f"http://r{i}" for i in range(n)]
    state, now = ready(), 1000.0
    for _ in range(6 * 3600 // 15):
        e = state.experiment
        reps = {}
        for u in urls:
            s = e.after if e is not None and e.canary == u else (state.settings or AT8)
            reps[u] = replica(u, running=6, max_num_seqs=s.max_num_seqs, tpot_share=0.5, finished=200)  # fmt: skip
        d, state = decide_tuning(view(reps), SPEC, state, AT8, now)
        assert d.kind != "lower", d.reason
        assert d.settings.max_num_seqs >= 8
        now += 15


def test_a_model_state_in_the_status_keeps_its_epoch_and_plan_memory():
    _, st = started()
    back = TunerState.from_status({"tuning": st.to_status(TuneDecision("hold", AT8, "x"), 1000.0)})
    assert back.experiment == st.experiment and back.planned_epoch == st.planned_epoch
    assert back.planned_at == 1000.0 and back.model.planned == (1000.0,)
    assert isinstance(back.model, ModelState) and back.model.fit() is not None
