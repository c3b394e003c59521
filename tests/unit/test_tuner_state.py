"""The tuner's memory in status.tuning (state.py, tuner_state.py): a round trip through the
status is lossless, hand-edited garbage is dropped without a crash, the history is bounded,
and a rejected setting backs off, doubling per rejection in a row."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

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
    Score,
    TuneDecision,
    Verdict,
)

S8 = EngineSettings(8, "auto")
S16 = EngineSettings(16, "auto", 1024)
FP8 = EngineSettings(8, "fp8", 2048)
SCORE = Score(
    goodput=90.5,
    throughput=100.25,
    waiting=1.5,
    itl_p99=0.0625,
    ttft_p99=None,
    samples=1200,
    seconds=60.5,
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
        slo_missed=True,
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
            replace(SCORE, goodput=40.0, itl_p99=0.25, ttft_p99=3.5),
        ),
        TuneDecision("canary", S8, "slot-bound", 1500.25, "raise", None, None),
    )
    verdicts = (Verdict(FP8.key, False, 1200.5, 2, 3000.5), Verdict(S16.key, True, 900.0, 0, 900.0))
    return TunerState(settings=S8, experiment=experiment, verdicts=verdicts, history=history)


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
            {"settings": "x", "kept": False},  # no times
            {**good["verdicts"][0], "retryAfter": "soon"},
            {**good["verdicts"][0], "strikes": None},
            7,
            good["verdicts"][1],
        ],
        "experiment": {**good["experiment"], "from": {"maxNumSeqs": "eight"}},
    }
    st = TunerState.from_status({"tuning": tuning})
    assert st.settings == S8
    assert st.history == (full_state().history[2],)
    assert st.verdicts == (full_state().verdicts[1],)
    assert st.experiment is None
    # Whole keys of the wrong type, and settings nobody can read.
    st = TunerState.from_status(
        {
            "tuning": {
                "maxNumSeqs": "many",
                "kvCacheDtype": "auto",
                "history": {"a": 1},
                "verdicts": "none",
                "experiment": "running",
            }
        }
    )
    assert st == TunerState()
    assert TunerState.from_status({"tuning": {"maxNumSeqs": None}}).settings is None


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


def test_rejections_back_off_doubling_up_to_a_cap_and_a_keep_clears_them():
    st = TunerState(settings=S8)
    base, cap = 900.0, 3000.0
    st = st.judged(S16, False, 100.0, base, cap)
    assert st.blocked(S16, 100.0 + base - 1) is not None and st.blocked(S16, 100.0 + base) is None
    st = st.judged(S16, False, 2000.0, base, cap)
    (v,) = st.verdicts
    assert (v.strikes, v.until) == (2, 2000.0 + 2 * base)
    st = st.judged(S16, False, 5000.0, base, cap)
    assert st.verdicts[0].until == 5000.0 + cap  # 4 x 900 capped at 3000
    assert st.blocked(S8, 5001.0) is None  # other settings are free
    st = st.judged(S16, True, 9000.0, base, cap)
    (v,) = st.verdicts
    assert v.kept and v.strikes == 0 and st.blocked(S16, 9000.0) is None
    st = st.judged(S16, False, 9100.0, base, cap)
    assert st.verdicts[0].strikes == 1 and st.verdicts[0].until == 9100.0 + base


def test_verdicts_are_bounded_and_the_oldest_forgotten():
    st = TunerState(settings=S8)
    for i in range(VERDICTS_KEPT + 3):
        st = st.judged(EngineSettings(i + 1), False, float(i), 900.0, 3600.0)
    assert len(st.verdicts) == VERDICTS_KEPT
    assert st.blocked(EngineSettings(1), 10.0) is None  # forgotten
    assert st.blocked(EngineSettings(VERDICTS_KEPT + 3), 40.0) is not None


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
    assert Verdict.from_status(Verdict("k", False, 1.5, 1, 2.25).to_status()).until == (
        pytest.approx(2.25)
    )
