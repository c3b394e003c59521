"""Scale to zero: the idle law (idle.py) alone, then through ClosedLoop.run_once against
simulated replicas: never to zero with a request running or waiting, the idle period kept
across operator restarts (status.autoscaling.lastActiveTime), a wake request newer than the
last activity brings one replica back, and an old one does not."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.idle import IdleState, busy, decide_idle
from batchpilot.operator.loop.timestamps import parse_timestamp
from batchpilot.operator.loop.tuner_state import EngineSettings
from batchpilot.operator.loop.turn import ClosedLoop
from tests.support.loop import Replicas, window

ZERO = parse_spec(
    {"autoscaling": {"enabled": True, "minReplicas": 0, "scaleToZeroAfterSeconds": 120}}
).autoscaling
QUIET = window(running=0, waiting=0, tokens=0)


def test_busy_is_any_work_in_the_window_or_at_the_latest_scrape():
    assert not busy(QUIET) and not busy(None)
    assert busy(window(running=1))
    assert busy(window(waiting=0.2))
    assert busy(window(tokens=0.5))  # a request served between two scrapes
    latest = window()
    assert busy(type(latest)(**{**latest.__dict__, "waiting_now": 1.0}))


@pytest.mark.parametrize("w", [window(running=1), window(waiting=1), window(tokens=3)])
def test_never_to_zero_with_work_in_flight_however_long_ago_the_period_began(w):
    d = decide_idle(ZERO, 1, w, True, IdleState(last_active=0.0), None, now=10_000.0)
    assert d.replicas is None and d.state.last_active == 10_000.0


def test_to_zero_after_the_idle_period_and_not_before():
    state = IdleState(last_active=1000.0, tokens_seen=0.0)
    early = decide_idle(ZERO, 1, QUIET, True, state, None, now=1119.0)
    assert early.replicas is None and early.state == state
    d = decide_idle(ZERO, 2, QUIET, True, state, None, now=1120.0)
    assert d.replicas == 0 and "idle for 120 s" in d.reason
    assert d.state == IdleState(last_active=1000.0, zero_since=1120.0, tokens_seen=0.0)


@pytest.mark.parametrize("w, scraped", [(None, True), (QUIET, False), (window(replicas=0), True)])
def test_never_to_zero_blind(w, scraped):
    d = decide_idle(ZERO, 1, w, scraped, IdleState(last_active=0.0), None, now=10_000.0)
    assert d.replicas is None


def test_tokens_served_between_two_scrapes_count_as_activity():
    """A woken replica answers what the activator held within seconds of turning Ready:
    its counter moved, though no rate over the window shows it yet."""
    fresh = dataclasses.replace(QUIET, generation_tokens_total=142.0)
    state = IdleState(last_active=1000.0, tokens_seen=0.0)
    d = decide_idle(ZERO, 1, fresh, True, state, None, now=1200.0)
    assert d.replicas is None and d.state == IdleState(last_active=1200.0, tokens_seen=142.0)
    # The counter still: idle from then on, and to zero after the period.
    later = decide_idle(ZERO, 1, fresh, True, d.state, None, now=1320.0)
    assert later.replicas == 0 and later.state.tokens_seen == 142.0


def test_the_first_look_starts_the_period():
    d = decide_idle(ZERO, 1, QUIET, True, IdleState(), None, now=500.0)
    assert d.replicas is None and d.state.last_active == 500.0


def test_min_replicas_above_zero_never_idles_and_keeps_nothing():
    one = parse_spec({"autoscaling": {"enabled": True}}).autoscaling
    d = decide_idle(one, 1, QUIET, True, IdleState(last_active=0.0), None, now=1e6)
    assert d.replicas is None and d.state == IdleState()


def test_at_zero_a_newer_wake_request_brings_one_replica_and_counts_as_activity():
    at_zero = IdleState(last_active=1000.0, zero_since=1120.0)
    stay = decide_idle(ZERO, 0, None, True, at_zero, None, now=2000.0)
    assert stay.replicas == 0 and stay.state == at_zero
    served = decide_idle(ZERO, 0, None, True, at_zero, 990.0, now=2000.0)
    assert served.replicas == 0  # the wake that was served before the zero
    woken = decide_idle(ZERO, 0, None, True, at_zero, 1990.0, now=2000.0)
    assert woken.replicas == 1 and woken.state == IdleState(last_active=2000.0)
    # Above zero, a wake not yet seen serving is the latest activity.
    d = decide_idle(ZERO, 1, QUIET, True, IdleState(last_active=1000.0), 1100.0, now=1200.0)
    assert d.replicas is None and d.state.last_active == 1100.0


# ---------------------------------------------------------------- through the closed loop

SPEC = parse_spec(
    {
        "engine": {"maxNumSeqs": 4},
        "autoscaling": {"enabled": True, "minReplicas": 0, "scaleToZeroAfterSeconds": 120},
    }
)


CLOCK = [0.0]  # the loops' clock: the simulated time of the turn


def new_loop(replicas: Replicas) -> ClosedLoop:
    return ClosedLoop(replicas, replicas, clock=lambda: CLOCK[0])


def turn(loop: ClosedLoop, replicas: Replicas, status: dict, now: float, wake_at=None):
    replicas.advance(now)
    CLOCK[0] = now
    outcome = asyncio.run(
        loop.run_once(
            "ns", "chat", SPEC, status, len(replicas.engines), EngineSettings(4), "secret", wake_at
        )
    )
    status.update(outcome.status_patch)
    return outcome


def test_a_served_burst_then_silence_goes_to_zero_once_and_a_restart_keeps_the_period():
    replicas, status = Replicas(1), {}
    loop = new_loop(replicas)
    replicas.load(6, 0.0)
    t, busy_seen, restarted = 0.0, False, None
    while t < 1800:
        t += 15
        outcome = turn(loop, replicas, status, t)
        engine = replicas.engines["http://r0"]
        if engine.running or engine.waiting:
            busy_seen = True
            assert outcome.desired_replicas == 1, "to zero with work in flight"
        if outcome.desired_replicas == 0:
            break
        last_active = parse_timestamp(status["autoscaling"]["lastActiveTime"])
        if restarted is None and busy_seen and t - last_active >= 60:
            # An operator restart half-way through the period: no samples, the period
            # read back from status.
            loop, restarted = new_loop(replicas), t
    assert busy_seen and restarted is not None and outcome.desired_replicas == 0
    assert "idle for" in dict(outcome.events)["ScaledToZero"]
    last_active = parse_timestamp(status["autoscaling"]["lastActiveTime"])
    # From the last activity, not from the restart (that would take until restart + 120).
    assert 120 <= t - last_active < 150 and t < restarted + 120
    assert parse_timestamp(status["autoscaling"]["scaledToZeroTime"]) == t


def test_never_to_zero_while_a_replica_of_the_deployment_is_not_scraped():
    """Two replicas in the Deployment, one answering (the other still starting, so not
    listed): however long the answering one idles, the service stays up."""
    replicas, status = Replicas(1), {"autoscaling": {"lastActiveTime": "2026-12-01T00:00:00Z"}}
    loop = new_loop(replicas)
    start = parse_timestamp("2026-12-01T00:00:00Z")
    for dt in range(15, 600, 15):
        replicas.advance(start + dt)
        CLOCK[0] = start + dt
        outcome = asyncio.run(
            loop.run_once("ns", "chat", SPEC, status, 2, EngineSettings(4), "secret")
        )
        status.update(outcome.status_patch)
        assert outcome.desired_replicas != 0, outcome


def test_at_zero_only_a_new_wake_request_brings_a_replica_back():
    status = {
        "autoscaling": {
            "desiredReplicas": 0,
            "lastActiveTime": "2026-12-02T00:00:00Z",
            "scaledToZeroTime": "2026-12-02T00:02:00Z",
            # Left from before the zero: at zero they must not read as demand.
            "recommendations": [{"replicas": 1, "time": "2026-12-02T00:01:50Z"}],
        }
    }
    zero_at = parse_timestamp("2026-12-02T00:02:00Z")
    none = Replicas(0)
    loop = new_loop(none)
    stale_wake = parse_timestamp("2026-12-01T23:59:00Z")
    for dt in (15, 30, 45):
        outcome = turn(loop, none, status, zero_at + dt, wake_at=stale_wake)
        assert outcome.desired_replicas == 0 and not outcome.events
    outcome = turn(loop, none, status, zero_at + 60, wake_at=zero_at + 58)
    assert outcome.desired_replicas == 1
    assert "activator holds a request" in dict(outcome.events)["WokenFromZero"]
    assert status["autoscaling"]["scaledToZeroTime"] is None
    assert parse_timestamp(status["autoscaling"]["lastActiveTime"]) == zero_at + 60
