"""turn.ClosedLoop.run_once: the status contract with the kopf side, statelessness across
operator restarts, a planned change on a canary and its rollout, a queue guardrail applied
at once, repair of stray replicas, refused applies, and a blind loop deciding nothing."""

from __future__ import annotations

import asyncio

from batchpilot import names
from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.state import LoopState
from batchpilot.operator.loop.tuner_state import EngineSettings
from batchpilot.operator.loop.turn import ClosedLoop
from tests.support.loop import Replicas

SPEC = parse_spec(
    {
        "engine": {"maxNumSeqs": 4},
        "autoscaling": {"enabled": True, "maxReplicas": 4},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 2, "max": 64}},
        "slo": {"timeToFirstTokenSeconds": 0.5, "interTokenLatencySeconds": 1.0},
    }
)  # fmt: skip


def run(loop: ClosedLoop, replicas: Replicas, status: dict, now: float, settings=None):
    replicas.advance(now)
    settings = settings or EngineSettings(LoopState.from_status(status).max_num_seqs or 4)
    outcome = asyncio.run(
        loop.run_once("ns", "chat", SPEC, status, len(replicas.engines), settings, "secret")
    )
    status.update(outcome.status_patch)
    return outcome


def until(loop, replicas, status, clock, action: str, start=0.0, end=900.0, in_system=3):
    """Turns every 15 s, with clients that keep ``in_system`` requests on each replica
    (topped up every second), until a tuning decision with ``action``."""
    t = start
    while t <= end:
        for k in range(15):
            replicas.top_up(in_system, t - 15 + k)
            replicas.advance(t - 14 + k)
        clock[0] = t
        outcome = run(loop, replicas, status, t)
        if outcome.tuning.action == action:
            return outcome
        t += 15
    raise AssertionError(f"no {action} by {end} s: {status.get('tuning')}")


def test_a_planned_raise_runs_on_a_canary_first_and_reaches_every_replica_once_kept():
    # Three short requests per replica against four slots: no queue, but the model, once
    # it has seen the steps, plans a larger max_num_seqs (within twice the batch it saw),
    # and the twin, replaying the arrival rate as Poisson arrivals, predicts that four
    # slots queue some requests past the 0.5 s TTFT target: the raise pays.
    replicas = Replicas(2, output=16)
    clock = [0.0]
    loop = ClosedLoop(replicas, replicas, clock=lambda: clock[0])
    status: dict = {}
    tried = until(loop, replicas, status, clock, "canary")
    canary = status["tuning"]["experiment"]["canary"]
    raised = status["tuning"]["experiment"]["to"]["maxNumSeqs"]
    assert raised > 4 and tried.tuning.kind == "raise"
    # Only the canary runs the raise; every replica keeps the settings in force.
    assert replicas.patches == [(canary, raised)]
    assert ("TuningTrial", tried.tuning.reason) in tried.events
    tuning = status["tuning"]
    assert tuning[names.MAX_NUM_SEQS.crd_field] == 4
    assert LoopState.from_status(status).max_num_seqs == 4
    assert tuning["inputs"]["plan"]["maxNumSeqs"] == raised and "modelEpoch" in tuning["inputs"]
    assert tuning["model"]["fit"]["largestBatchObserved"] > 0
    assert status["autoscaling"]["desiredReplicas"] == 2
    kept = until(loop, replicas, status, clock, "rollout", start=clock[0] + 15)
    other = "http://r1" if canary == "http://r0" else "http://r0"
    assert (other, raised) in replicas.patches
    assert ("TuningKept", kept.tuning.reason) in kept.events
    assert kept.tuning.after.requests >= 10 and kept.tuning.after.attainment == 1.0
    assert LoopState.from_status(status).max_num_seqs == raised
    assert status["tuning"]["experiment"] is None
    assert status["tuning"]["verdicts"][-1]["kept"] is True


def test_a_restarted_operator_goes_on_judging_the_trial_it_finds_in_status():
    replicas = Replicas(2, output=16)
    clock = [0.0]
    loop = ClosedLoop(replicas, replicas, clock=lambda: clock[0])
    status: dict = {}
    until(loop, replicas, status, clock, "canary")
    started = clock[0]
    # A new operator process: fresh loop, no samples, only the status (the model included).
    restarted = ClosedLoop(replicas, replicas, clock=lambda: clock[0])
    kept = until(restarted, replicas, status, clock, "rollout", start=started + 15)
    assert kept.tuning.kind == "raise"
    assert [h["action"] for h in status["tuning"]["history"]] == ["canary", "rollout"]
    # Then nothing is planned again under the same model, also across a restart.
    again = ClosedLoop(replicas, replicas, clock=lambda: clock[0])
    for _ in range(3):
        clock[0] += 15
        outcome = run(again, replicas, status, clock[0])
    assert outcome.tuning.action == "hold", outcome.tuning.reason


def test_a_queue_is_raised_at_once_on_every_replica_with_an_event():
    replicas = Replicas(2)  # 12 in the system per replica against 4 slots
    clock = [0.0]
    loop = ClosedLoop(replicas, replicas, clock=lambda: clock[0])
    status: dict = {}
    guard = until(loop, replicas, status, clock, "guard", in_system=12)
    assert guard.tuning.kind == "raise" and guard.tuning.reason.startswith("guardrail: queue:")
    raised = guard.tuning.settings.max_num_seqs
    assert raised > 4
    # On every replica in the same turn, with no trial of its own.
    assert sorted(replicas.patches[-2:]) == [("http://r0", raised), ("http://r1", raised)]
    assert all(e.max_num_seqs == raised for e in replicas.engines.values())
    assert ("TuningGuardrail", guard.tuning.reason) in guard.events
    assert status["tuning"]["experiment"] is None
    assert LoopState.from_status(status).max_num_seqs == raised


def test_a_stray_replica_is_repaired_and_an_unreachable_one_is_skipped_and_counted():
    replicas = Replicas(3, max_num_seqs=8)
    replicas.engines["http://r2"].max_num_seqs = 4  # started from an old template
    replicas.down.add("http://r1")
    loop = ClosedLoop(replicas, replicas, clock=lambda: 0.0)
    status = {"tuning": {names.MAX_NUM_SEQS.crd_field: 8, names.KV_CACHE_DTYPE.crd_field: "auto"}}
    outcome = run(loop, replicas, status, 0.0, EngineSettings(8))
    assert replicas.patches == [("http://r2", 8)]
    assert outcome.scraped == 2 and set(outcome.scrape_failures) == {"http://r1"}
    assert status["metrics"]["scrapeFailures"] == 1
    assert status["tuning"]["notApplied"] == []


def test_a_refused_apply_is_counted_and_not_recorded_as_applied():
    replicas = Replicas(2, max_num_seqs=4)
    replicas.refusing.add("http://r1")
    loop = ClosedLoop(replicas, replicas, clock=lambda: 0.0)
    status = {"tuning": {names.MAX_NUM_SEQS.crd_field: 8, names.KV_CACHE_DTYPE.crd_field: "auto"}}
    outcome = run(loop, replicas, status, 0.0, EngineSettings(8))
    assert set(outcome.apply_failures) == {"http://r1"}
    assert status["tuning"]["notApplied"] == [
        {"replica": "http://r1", "reason": outcome.apply_failures["http://r1"]}
    ]
    assert replicas.engines["http://r1"].max_num_seqs == 4
    assert any(r == "AdminApplyFailed" and "1 of 2" in m for r, m in outcome.events)


def test_a_blind_loop_decides_nothing_and_says_so_until_it_sees_again():
    replicas = Replicas(4)
    replicas.load(40, 0.0)
    replicas.down.update({"http://r1", "http://r2", "http://r3"})
    loop = ClosedLoop(replicas, replicas, clock=lambda: 0.0)
    status: dict = {}
    blind = run(loop, replicas, status, 0.0)
    assert blind.blind and "1 of 4 Ready replicas answered" in blind.blind
    assert status["metrics"]["loopBlind"] == blind.blind
    assert [r for r, _ in blind.events] == ["LoopBlind"]
    assert blind.desired_replicas == 4 and blind.tuning.action == "hold"
    assert replicas.patches == []
    still = run(loop, replicas, status, 15.0)
    assert still.events == []  # one Event per episode
    replicas.down.clear()
    seen = run(loop, replicas, status, 30.0)
    assert seen.blind is None and status["metrics"]["loopBlind"] is None
    assert ("LoopSighted", "enough replicas answer again: deciding") in seen.events


def test_hand_edited_history_is_ignored_and_history_stays_bounded():
    replicas = Replicas(1)
    junk = [{"time": "yesterday", "action": "keep"}]
    old = [
        {"time": f"2026-01-01T00:00:{i:02d}.000Z", "action": "keep", "kind": "raise",
         "maxNumSeqs": 4, "kvCacheDtype": "auto", "reason": ""}
        for i in range(30)
    ]  # fmt: skip
    status = {"tuning": {"history": junk + old, "maxNumSeqs": 4, "kvCacheDtype": "auto"}}
    loop = ClosedLoop(replicas, replicas, clock=lambda: 2e9)
    run(loop, replicas, status, 0.0)
    assert len(status["tuning"]["history"]) == 20
