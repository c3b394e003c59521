"""The tuner's memory in status.tuning (state.py, tuner_state.py): a round trip through the
status is lossless (the model's state included), hand-edited garbage is dropped without a
crash, the history is bounded, and a failed test blocks its move only under the model epoch
it was made in."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from batchpilot.operator.loop.model_state import ModelState
from batchpilot.operator.loop.state import (
    HISTORY_LENGTH,
    VERDICTS_KEPT,
    TunerState,
    settings_from_status,
)
from batchpilot.operator.loop.timestamps import timestamp
from batchpilot.operator.loop.tuner_state import (
    EngineSettings,
    Experiment,
    Move,
    OverloadRaise,
    Score,
    TuneDecision,
    Verdict,
)
from tests.support.loop import ready_model

S8 = EngineSettings(8, "auto")
S16 = EngineSettings(16, "auto", 1024)
FP8 = EngineSettings(8, "fp8", 2048)
SCORE = Score(
    requests=120.0,
    attainment=0.9375,
    throughput=100.25,
    running=6.5,
    waiting=1.5,
    seconds=60.5,
    tpot_p90=0.0625,
    ttft_p99=None,
)


def full_state() -> TunerState:
    experiment = Experiment(
        kind="raise",
        before=S8,
        after=S16,
        started=1500.25,
        reason="slot-bound",
        baseline=SCORE,
        canary="http://r0",
        epoch=2,
    )
    history = (
        TuneDecision("try", FP8, "memory-bound", 1000.0, "fp8", SCORE, None),
        TuneDecision(
            "revert",
            S8,
            "not better",
            1200.5,
            "fp8",
            SCORE,
            replace(SCORE, attainment=0.5, tpot_p90=0.25, ttft_p99=3.5),
        ),
        TuneDecision("canary", S8, "slot-bound", 1500.25, "raise", None, None),
    )
    verdicts = (Verdict(FP8.key, False, 1200.5, 2), Verdict(S16.key, True, 900.0, 0))
    return TunerState(settings=S8, experiment=experiment, verdicts=verdicts, history=history,
                      planned_epoch=2, planned_at=1500.25)  # fmt: skip


def through_json(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_a_round_trip_through_the_status_is_lossless():
    st = full_state()
    latest = TuneDecision("hold", S8, "judging", 1600.0, inputs={"replicas": 2})
    status = through_json(st.to_status(latest, 1600.0))
    assert status["maxNumSeqs"] == 8 and status["lastDecision"] == "hold"
    assert status["inputs"] == {"replicas": 2}
    assert status["experiment"]["canary"] == "http://r0"
    assert TunerState.from_status({"tuning": status}) == st
    assert status["plan"] == {"epoch": 2, "time": 1500.25, "requests": 0.0}
    # With a fitted model: its statistics, demand and memory come back (the floats rounded
    # for the status, so the fit compares within that rounding).
    model = replace(ready_model(), epoch=4, planned=(1400.0,), queue=(0.5, 1.5))
    status = through_json(replace(st, model=model).to_status(latest, 1600.0))
    assert status["model"]["fit"]["identified"] is True
    back = TunerState.from_status({"tuning": status})
    assert replace(back, model=ModelState()) == st
    assert (back.model.epoch, back.model.planned, back.model.queue) == (4, (1400.0,), (0.5, 1.5))
    assert back.model.fit().beta == pytest.approx(model.fit().beta, rel=1e-6)
    assert back.model.demand.to_status() == model.demand.to_status()
    # And the empty state: no experiment is written as None (a merge patch removes it).
    bare = TunerState(settings=FP8)
    status = through_json(bare.to_status(latest, 1600.0))
    assert status["experiment"] is None and status["maxNumBatchedTokens"] == 2048
    assert TunerState.from_status({"tuning": status}) == bare


def test_no_status_is_an_empty_state():
    assert TunerState.from_status(None) == TunerState()
    assert TunerState.from_status({}) == TunerState()
    assert TunerState.from_status({"tuning": None}) == TunerState()
    assert settings_from_status(None) is None
    assert settings_from_status({"tuning": {"maxNumSeqs": 12, "kvCacheDtype": "fp8"}}) == (
        EngineSettings(12, "fp8")
    )


def test_hand_edited_garbage_is_dropped_never_raised():
    good = through_json(full_state().to_status(TuneDecision("hold", S8, "x", 0.0), 1600.0))
    tuning = {
        **good,
        "history": [
            "not a decision",
            {"action": "keep"},  # no time, no settings
            {**good["history"][0], "time": "yesterday"},
            {**good["history"][0], "maxNumSeqs": "many"},
            {**good["history"][1], "after": {"tokensPerSecond": 3}},  # a broken score
            good["history"][2],
        ],
        "verdicts": [
            {"settings": "x", "kept": False},  # no time
            {**good["verdicts"][0], "time": "soon"},
            {**good["verdicts"][0], "epoch": "first"},
            7,
            good["verdicts"][1],
        ],
        "experiment": {**good["experiment"], "from": {"maxNumSeqs": "eight"}},
        "model": {"step": {"xtx": [1.0]}, "demand": {}},  # a model of another shape
    }
    st = TunerState.from_status({"tuning": tuning})
    assert st.settings == S8
    assert st.history == (full_state().history[2],)
    assert st.verdicts == (full_state().verdicts[1],)
    assert st.experiment is None and st.model == ModelState()
    # Whole keys of the wrong type, and settings nobody can read.
    st = TunerState.from_status(
        {
            "tuning": {
                "maxNumSeqs": "many",
                "kvCacheDtype": "auto",
                "history": {"a": 1},
                "verdicts": "none",
                "experiment": "running",
                "model": "fitted",
                "plan": [],
            }
        }
    )
    assert st == TunerState()
    assert TunerState.from_status({"tuning": {"maxNumSeqs": None}}).settings is None


def test_the_overload_raise_memory_round_trips_and_a_broken_one_is_dropped():
    latest = TuneDecision("hold", S8, "x", 1600.0)
    o = OverloadRaise(1500.25, 16, 32, 12, (2.0, 0.06))
    for memory in (o, replace(o, clear_since=1590.5)):
        st = replace(full_state(), overload=memory)
        status = through_json(st.to_status(latest, 1600.0))
        assert status["overloadRaise"]["from"] == 16 and status["overloadRaise"]["to"] == 32
        assert TunerState.from_status({"tuning": status}) == st
    # None is written as None: the merge patch removes a memory that no longer binds.
    assert full_state().to_status(latest, 1600.0)["overloadRaise"] is None
    good = through_json(replace(full_state(), overload=o).to_status(latest, 1600.0))
    for broken in ({**good["overloadRaise"], "targets": [2.0]}, {"time": "now"}, "yes"):
        back = TunerState.from_status({"tuning": {**good, "overloadRaise": broken}})
        assert back.overload is None and back.settings == S8


def test_the_history_keeps_the_latest_changes_only_and_not_holds():
    st = TunerState(settings=S8)
    for i in range(HISTORY_LENGTH + 7):
        d = TuneDecision(
            "keep", EngineSettings(8 + i), f"kept {i}", float(i), "raise", inputs={"big": "x" * 100}
        )
        st = st.decided(d, None)
        st = st.decided(TuneDecision("hold", st.settings, "holding", i + 0.5), None)
    assert len(st.history) == HISTORY_LENGTH
    assert [d.time for d in st.history] == [float(i) for i in range(7, HISTORY_LENGTH + 7)]
    assert all(d.action == "keep" and d.inputs == {} for d in st.history)
    assert st.last_change == HISTORY_LENGTH + 6
    assert st.settings == EngineSettings(8 + HISTORY_LENGTH + 6)  # a hold keeps what is in force
    status = st.to_status(TuneDecision("hold", st.settings, "x", 0.0), 0.0)
    assert len(status["history"]) == HISTORY_LENGTH


def test_a_failed_test_blocks_its_move_under_the_same_epoch_only():
    st = TunerState(settings=S8)
    raise8 = Move(S8, "raise")
    st = st.judged(raise8, False, 100.0, epoch=3)
    assert st.blocked(raise8, 3) is not None
    assert st.blocked(raise8, 4) is None  # the model changed: it may propose it again
    assert st.blocked(Move(S8, "lower"), 3) is None  # another kind of move is free
    assert st.blocked(Move(S16, "raise"), 3) is None  # and the same kind from elsewhere
    # Keyed by where the move starts: a raise from 8 to anything is the same move.
    assert raise8.key == Move(S8, "raise").key != Move(S16, "raise").key
    # The latest verdict on a move replaces the earlier one; a keep blocks nothing.
    st = st.judged(raise8, True, 200.0, epoch=3)
    (v,) = st.verdicts
    assert v.kept and v.time == 200.0 and st.blocked(raise8, 3) is None


def test_verdicts_are_bounded_and_the_oldest_forgotten():
    st = TunerState(settings=S8)
    for i in range(VERDICTS_KEPT + 3):
        st = st.judged(Move(EngineSettings(i + 1), "raise"), False, float(i), 0)
    assert len(st.verdicts) == VERDICTS_KEPT
    assert st.blocked(Move(EngineSettings(1), "raise"), 0) is None  # forgotten
    assert st.blocked(Move(EngineSettings(VERDICTS_KEPT + 3), "raise"), 0) is not None


def test_settings_keys_and_live_changes():
    assert S8.key != EngineSettings(8, "fp8").key != EngineSettings(8, "auto", 512).key
    assert S8.key == EngineSettings(8, "auto", None).key
    assert S16.live_changes(S8) == {"max_num_seqs": 16, "max_num_batched_tokens": 1024}
    assert S16.live_changes(S16) == {}
    # The dtype is not a live knob; a budget nobody tunes is never sent.
    assert EngineSettings(8, "fp8").live_changes(S8) == {}
    assert S8.live_changes(EngineSettings(8, "auto", 1024)) == {}


def test_timestamps_are_rfc3339_in_utc():
    assert timestamp(0.0) == "1970-01-01T00:00:00.000Z"
    v = Verdict.from_status(Verdict("k", False, 2.25, 1).to_status())
    assert v.time == pytest.approx(2.25) and v.epoch == 1
