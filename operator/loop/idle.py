"""Scale to zero: the idle law. Pure: no I/O, no clock.

With ``autoscaling.minReplicas: 0`` (builtin mode), a service whose replicas ran nothing,
queued nothing and generated no token for ``scaleToZeroAfterSeconds`` goes to zero
replicas. Never blind: every replica of the Deployment must be Ready and have answered this
turn's scrape (a replica still starting may be about to serve what the activator holds),
and the latest scrape must show no request running or waiting (the window's means could
hide one that arrived since). Tokens are counted two ways: their rate over the window, and
the replicas' summed counter against the one seen last turn, which also catches requests
that a fresh replica served before its second scrape (a woken replica answering what was
held, all within seconds of turning Ready).

The idle period runs from the last activity the loop saw, kept in
``status.autoscaling.lastActiveTime``: an operator restart neither restarts nor skips it.

At zero, a wake request (the activator's annotation ``batchpilot.dev/wake-requested-at``,
written when it holds a request) newer than the last activity brings one replica back, and
counts as activity: the replica gets a whole idle period to serve what was held.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot.operator.crd.autoscaling import AutoscalingSpec
from batchpilot.operator.loop.observe import Window

WAKE_ANNOTATION = "batchpilot.dev/wake-requested-at"


@dataclass(frozen=True)
class IdleState:
    """What the law remembers (status.autoscaling.lastActiveTime, .scaledToZeroTime)."""

    last_active: float | None = None
    zero_since: float | None = None  # when it went to zero; None above zero
    tokens_seen: float | None = None  # the replicas' generation-token counters, summed


@dataclass(frozen=True)
class IdleDecision:
    replicas: int | None  # None: the queue law's decision stands
    reason: str
    state: IdleState


def busy(window: Window | None, tokens_seen: float | None = None) -> bool:
    """Did any replica run, queue or generate anything in the window, or at its latest
    scrape, or did the token counters move since ``tokens_seen``?"""
    if window is None or window.replicas == 0:
        return False
    return (
        window.running_now > 0
        or window.waiting_now > 0
        or window.running > 0
        or window.waiting > 0
        or window.generation_tokens_per_second > 0
        or (tokens_seen is not None and window.generation_tokens_total != tokens_seen)
    )


def decide_idle(
    spec: AutoscalingSpec,
    replicas: int,
    window: Window | None,
    all_scraped: bool,
    state: IdleState,
    wake_at: float | None,
    now: float,
) -> IdleDecision:
    """``replicas``: the Deployment's count now. ``all_scraped``: every one of them is Ready
    and answered this turn. ``wake_at``: the latest wake request, if any."""
    if spec.min_replicas > 0:
        return IdleDecision(None, "", IdleState())
    if replicas == 0:
        # Newer than the last activity: a wake request that was served already (or the one
        # read from a stale copy of the status) does not wake it again.
        if wake_at is not None and (state.last_active is None or wake_at > state.last_active):
            why = "woken from zero: the activator holds a request"
            woken = IdleState(last_active=max(wake_at, now), tokens_seen=state.tokens_seen)
            return IdleDecision(1, why, woken)
        return IdleDecision(0, "at zero: waiting for a request", state)
    last = state.last_active
    if last is None or busy(window, state.tokens_seen):
        last = now
    if wake_at is not None and wake_at > last:
        last = wake_at  # woken, and not yet seen serving: the wake is the latest activity
    idle_for = now - last
    seen = window.generation_tokens_total if window and window.replicas else state.tokens_seen
    active = IdleState(last_active=last, tokens_seen=seen)
    if idle_for < spec.scale_to_zero_after_seconds:
        return IdleDecision(None, "", active)
    if window is None or window.replicas == 0 or not all_scraped:
        return IdleDecision(None, "", active)  # cannot see every replica: never to zero blind
    why = (
        f"idle for {idle_for:.0f} s (scaleToZeroAfterSeconds "
        f"{spec.scale_to_zero_after_seconds}): nothing ran, waited or was generated"
    )
    return IdleDecision(0, why, IdleState(last_active=last, zero_since=now, tokens_seen=seen))
