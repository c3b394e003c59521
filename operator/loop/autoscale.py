"""The autoscaler's control law: desired replicas from queue length. Pure: no I/O, no clock.

Each replica is worth ``slots + targetQueueLength`` requests in the system: ``slots`` is
what it runs at once (``max_num_seqs``, or fewer when the KV cache fills first) and the
target is how many may wait behind them. The raw recommendation is the number of such
replicas the requests in the system (running + waiting, from the latest scrape) need; it
exceeds the current count exactly when the queue per replica is over ``targetQueueLength``
with every slot busy.

Requests in the system do not shrink in proportion to replicas: fewer replicas run bigger
batches, and a bigger batch steps slower (Little's law with a service time that grows with
the batch). So a scale-down must also pass a throughput test: the tokens per second the
service generates now, shared by fewer replicas, must stay under 90% of what one replica
was measured to sustain while it had a queue (``capacity``, kept in status per engine
settings: a figure measured at max_num_seqs 8 says nothing about 32). Without a figure for
the settings in force a scale-down relies on slots alone; the first saturation measures it.

Around it, Kubernetes HPA semantics: a recommendation within a 10% tolerance of the current
count changes nothing; scale up to the lowest recommendation of the last
``scaleUpStabilizationSeconds`` and down to the highest of the last
``scaleDownStabilizationSeconds``; a bounded step; min and max. Under steady load the
recommendation is steady, so the replica count is too: it cannot flap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from batchpilot.operator.crd.autoscaling import AutoscalingSpec
from batchpilot.operator.loop.observe import Window
from batchpilot.operator.loop.tuner_state import EngineSettings

TOLERANCE = 0.1  # HPA's default: a ratio within 10% of 1 is no reason to move
KV_USAGE_FLOOR = 0.05  # below this the KV cache says nothing about how many sequences fit
SATURATED_QUEUE = 1.0  # mean waiting per replica over the window that counts as saturated
MEASURE_SECONDS = 30.0  # a shorter window (one scrape after a change) measures no capacity
# After a scale-up, further ones wait until the new pods serve (a queue cannot move to a pod
# that is still loading its model), but not forever: a pod that never gets Ready within
# this grace does not block the autoscaler.
STARTUP_GRACE_SECONDS = 600.0


def max_step_up(current: int) -> int:
    """At most double, and at least +2, per decision (HPA's default policy is +100% or +4
    per 15 s; a model server starts in minutes, so a step that overshoots costs more)."""
    return max(2, current)


def max_step_down(current: int) -> int:
    """At most halve per decision: a wrong scale-down drops capacity under load."""
    return max(1, current // 2)


@dataclass(frozen=True)
class Recommendation:
    """The last time the raw law recommended ``replicas``. One entry per distinct value is
    all the stabilization windows need (they ask whether a value occurred within them), so
    the history stays small under any window length."""

    replicas: int
    time: float


@dataclass(frozen=True)
class ScaleHistory:
    """What the law remembers between decisions (status.autoscaling keeps it)."""

    recommendations: tuple[Recommendation, ...] = ()
    # Generation tokens/s one replica sustained with a queue, per EngineSettings.key.
    capacities: tuple[tuple[str, float], ...] = ()
    last_scale_up: float | None = None

    def capacity(self, settings: str) -> float | None:
        return dict(self.capacities).get(settings)


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    reason: str
    recommendation: int  # the raw law's value this time, before stabilization
    history: ScaleHistory = ScaleHistory()  # to store, for the next decision


@dataclass(frozen=True)
class ScaleDownHold:
    """A scale-down held at ``replicas`` because some Ready replicas did not answer their
    scrape (``unscraped``): the others alone recommended ``recommendation``."""

    replicas: int
    recommendation: int
    unscraped: tuple[str, ...]


def _slots_per_replica(window: Window, max_num_seqs: int | None = None) -> float | None:
    """Sequences one replica runs at once: max_num_seqs (the one chosen, else the one the
    replicas report), or what its KV cache holds at the observed usage per running
    sequence, whichever is smaller."""
    running = window.per_replica(window.running)
    slots = max_num_seqs or window.max_num_seqs_in_force
    if window.kv_cache_usage > KV_USAGE_FLOOR and running > 0:
        kv_slots = running / window.kv_cache_usage
        slots = kv_slots if slots is None else min(slots, kv_slots)
    if slots is None and window.waiting > 0:
        slots = running  # saturated, and nothing better known
    return slots


CAPACITIES_KEPT = 8  # settings whose capacity figure is remembered


def measured_capacities(
    windows: Sequence[Window], history: ScaleHistory, settings: str
) -> tuple[tuple[str, float], ...]:
    """A replica's sustainable generation rate under ``settings``: the mean rate of the
    replicas (or merged windows, per replica) that had a queue both on average over their
    window and at its latest scrape, as they then generate as fast as they can; else the
    figures kept. A queue on average alone is not enough: one left over from a change,
    drained early in the window, reads as saturation at a fraction of the capacity; so
    is one scrape's queue of one."""
    rates = [
        w.per_replica(w.generation_tokens_per_second)
        for w in windows
        if w.replicas
        and w.span_seconds >= MEASURE_SECONDS
        and min(w.per_replica(w.waiting), w.per_replica(w.waiting_now)) >= SATURATED_QUEUE
        and w.generation_tokens_per_second > 0
    ]
    if not rates:
        return history.capacities
    others = tuple((k, v) for k, v in history.capacities if k != settings)
    return (*others, (settings, sum(rates) / len(rates)))[-CAPACITIES_KEPT:]


def recommend(
    window: Window | None,
    spec: AutoscalingSpec,
    current: int,
    capacity: float | None,
    by_model: int | None = None,
    max_num_seqs: int | None = None,
) -> tuple[int, str]:
    """The raw law: (replicas, why), before stabilization, steps and bounds. ``by_model``:
    the replicas the tuner's model sizes the service at (the decayed arrival rate over 0.8 x
    a replica's capacity within the SLO); the queue law is the fast guard, and the larger
    of the two rules. ``max_num_seqs``: the one the replicas run from now on."""
    raw, why = _queue_law(window, spec, current, capacity, max_num_seqs)
    if by_model is not None and by_model > raw:
        return by_model, f"the model's capacity needs {by_model} replicas; the queue law: {why}"
    return raw, why


def _queue_law(
    window: Window | None,
    spec: AutoscalingSpec,
    current: int,
    capacity: float | None,
    max_num_seqs: int | None = None,
) -> tuple[int, str]:
    if window is None or window.replicas == 0:
        return current, "no metrics: holding"
    slots = _slots_per_replica(window, max_num_seqs)
    if not slots:
        return current, "idle replicas report no capacity figure: holding"
    demand = window.running_now + window.waiting_now
    needed = demand / (slots + spec.target_queue_length)
    facts = (
        f"{demand:.1f} requests in the system ({window.per_replica(window.waiting_now):.1f} "
        f"waiting per replica, target {spec.target_queue_length:g}), {slots:.1f} slots per replica"
    )
    if current > 0 and abs(needed / current - 1) <= TOLERANCE:
        return current, f"{facts}: within tolerance of {current}"
    raw = max(1, math.ceil(needed))
    if raw < current and capacity:
        rate = window.generation_tokens_per_second
        floor = min(current, math.ceil(rate / (capacity * (1 - TOLERANCE))))
        if floor > raw:
            return floor, (
                f"{facts}: needs {needed:.2f} replicas by slots, but {rate:.0f} tokens/s at "
                f"{capacity:.0f} per replica needs {floor}"
            )
    return raw, f"{facts}: needs {needed:.2f} replicas"


def stabilize(
    history: Sequence[Recommendation],
    raw: int,
    now: float,
    spec: AutoscalingSpec,
) -> tuple[int, int, tuple[Recommendation, ...]]:
    """(lowest recommendation over the up-window, highest over the down-window, new history).
    A window holds what was recommended after ``now - window`` (HPA's cutoff); the latest
    recommendation is always in it."""
    keep = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
    latest = {r.replicas: r.time for r in history if r.time >= now - keep}
    latest[raw] = now
    new_history = tuple(Recommendation(n, t) for n, t in sorted(latest.items()))
    up_cut = now - spec.scale_up_stabilization_seconds
    down_cut = now - spec.scale_down_stabilization_seconds
    up = [raw, *(r.replicas for r in new_history if r.time > up_cut)]
    down = [raw, *(r.replicas for r in new_history if r.time > down_cut)]
    return min(up), max(down), new_history


def decide_replicas(
    window: Window | None,
    spec: AutoscalingSpec,
    current: int,
    now: float,
    history: ScaleHistory = ScaleHistory(),
    settings: EngineSettings | None = None,
    by_model: int | None = None,
    measured: tuple[str, Sequence[Window]] | None = None,
) -> ScaleDecision:
    """``settings``: the engine settings the replicas run from now on (None: what they
    report), whose slots the queue law counts and whose capacity figure bounds a
    scale-down; ``measured``: the key of those that ran, and each replica's window since
    they were set, which a capacity is measured in (``settings`` and ``window`` when None:
    nothing changed). ``by_model``: the replicas the tuner's model sizes the service at."""
    key = settings.key if settings is not None else ""
    ran, since_set = measured or (key, [window] if window is not None else [])
    capacities = measured_capacities(since_set, history, ran)
    mns = settings.max_num_seqs if settings is not None else None
    raw, why = recommend(window, spec, current, dict(capacities).get(key), by_model, mns)
    # A service seen for the first time has its current count as the only recommendation
    # so far: a first burst waits out the up-window like any other.
    recommendations = history.recommendations or (Recommendation(current, now),)
    up_rec, down_rec, kept = stabilize(recommendations, raw, now, spec)
    last_up = history.last_scale_up
    starting = window is not None and window.replicas < current
    if (
        current < up_rec
        and starting
        and last_up is not None
        and now - last_up < STARTUP_GRACE_SECONDS
    ):
        target = current
        reason = f"waiting for {current - window.replicas} starting replicas: {why}"
    elif current < up_rec:
        target = min(up_rec, current + max_step_up(current))
        reason = f"scale up: {why}"
        if target < up_rec:
            reason += f"; step bounded to +{max_step_up(current)}"
    elif current > down_rec:
        target = max(down_rec, current - max_step_down(current))
        reason = f"scale down: {why}"
        if target > down_rec:
            reason += f"; step bounded to -{max_step_down(current)}"
    else:
        target = current
        reason = why if raw == current else f"stabilizing at {current}: {why}"
    bounded = min(spec.max_replicas, max(spec.min_replicas, target))
    if bounded != target:
        reason += f"; held within [{spec.min_replicas}, {spec.max_replicas}]"
    if bounded > current:
        last_up = now
    return ScaleDecision(bounded, reason, raw, ScaleHistory(kept, capacities, last_up))
