"""The tuner's control law: max_num_seqs and the KV-cache dtype from a metrics window.
Pure: no I/O, no clock; the history of past changes comes in as an argument.

The seed document's manual rules (§4.1, §5.1, §6), made continuous:

- memory-bound (preemptions or swaps per minute over a bound): switch the KV cache to fp8
  when allowed and not on yet (the same memory holds twice the sequences), else lower
  max_num_seqs below the batch that actually runs;
- latency-bound (ITL P99 over targetInterTokenLatencySeconds): lower max_num_seqs;
- KV cache full with a queue but no thrash: fp8 when allowed, else hold (a lower
  max_num_seqs would not add room, the engine's admission already stops at the KV limit);
- slot-bound (running ≈ max_num_seqs, a queue, KV usage under a bound, no preemption, ITL
  P99 with headroom under its target): raise max_num_seqs;
- otherwise hold.

Safety: spec bounds; a raise at most doubles and stops where the KV cache would pass
``kv_raise_bound`` at today's usage per sequence; a lower takes at most a quarter off the
batch that runs; one change per cooldown, judged on a window that starts after the last
change; and hysteresis: a raise needs ITL P99 under ``latency_headroom`` x target while a
lower needs it over the target, and after a lower the tuner does not raise above the
lowered value for ``memory_seconds`` (same KV dtype). So a value that thrashed or was too
slow is not tried again, and the setting cannot oscillate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from batchpilot.operator.crd import TuningSpec
from batchpilot.operator.observe import Window

Kind = Literal["raise", "lower", "fp8", "hold"]
FP8 = "fp8"
HISTORY_LENGTH = 20  # changes kept in status.tuning.history


@dataclass(frozen=True)
class TuneLimits:
    """The law's thresholds. Not in the CRD: they describe the engine, not a workload."""

    thrash_per_minute: float = 2.0  # preemptions or swaps per minute per replica
    slot_busy_fraction: float = 0.85  # running >= this x max_num_seqs is "all slots busy"
    min_waiting: float = 0.5  # mean waiting per replica that counts as a queue
    kv_raise_bound: float = 0.85  # a raise stops where KV usage would reach this
    kv_full: float = 0.95  # KV usage that counts as full
    latency_headroom: float = 0.8  # raise only with ITL P99 under this x target
    raise_factor: float = 2.0  # most a raise multiplies max_num_seqs by
    min_raise_fraction: float = 0.1  # a smaller raise is not worth a decision
    lower_factor: float = 0.75  # a lower sets max_num_seqs to this x the running batch
    min_window_seconds: float = 20.0  # least observation after a change before judging it
    # A P99 over fewer gaps is the window's few worst steps (one long prefill): noise, not
    # a latency level. Below this many ITL observations latency is treated as unknown.
    min_latency_samples: int = 500
    memory_seconds: float = 3600.0  # how long a lowered value caps later raises


@dataclass(frozen=True)
class EngineSettings:
    max_num_seqs: int
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class TuneRecord:
    """A past change, as status.tuning.history keeps it."""

    time: float
    kind: Kind
    max_num_seqs: int  # after the change
    previous_max_num_seqs: int
    kv_cache_dtype: str
    reason: str = ""


@dataclass(frozen=True)
class TuneDecision:
    kind: Kind
    max_num_seqs: int
    kv_cache_dtype: str
    reason: str
    inputs: dict = field(default_factory=dict)

    @property
    def changes(self) -> bool:
        return self.kind != "hold"


def is_fp8(dtype: str) -> bool:
    return dtype.startswith(FP8)


def last_change(history: Sequence[TuneRecord]) -> TuneRecord | None:
    return max(history, key=lambda r: r.time, default=None)


def raise_ceiling(history: Sequence[TuneRecord], dtype: str, now: float, memory: float) -> int:
    """The lowest value a recent lower set, for this KV dtype: raises stay at or below it."""
    lowered = [
        r.max_num_seqs
        for r in history
        if r.kind == "lower" and r.kv_cache_dtype == dtype and now - r.time < memory
    ]
    return min(lowered, default=math.inf)  # type: ignore[arg-type]


def inputs_of(window: Window, settings: EngineSettings) -> dict:
    """What the decision saw, per replica, for status and Events."""
    per = window.per_replica
    out = {
        "replicas": window.replicas,
        "windowSeconds": round(window.span_seconds, 1),
        "maxNumSeqs": settings.max_num_seqs,
        "kvCacheDtype": settings.kv_cache_dtype,
        "runningPerReplica": round(per(window.running), 2),
        "waitingPerReplica": round(per(window.waiting), 2),
        "kvCacheUsage": round(window.kv_cache_usage, 3),
        "preemptionsPerMinutePerReplica": round(per(window.preemptions_per_minute), 2),
        "swapsPerMinutePerReplica": round(per(window.swaps_per_minute), 2),
    }
    if window.itl_p99 is not None:
        out["itlP99Seconds"] = round(window.itl_p99, 4)
    return out


@dataclass(frozen=True)
class Signals:
    """The window reduced to what the law compares, per replica."""

    running: float
    waiting: float
    kv_usage: float
    kv_peak: float
    thrash: float  # preemptions or swaps per minute, whichever is higher
    itl_p99: float | None

    @classmethod
    def of(cls, w: Window, limits: TuneLimits) -> Signals:
        enough = bool(w.itl_buckets) and w.itl_buckets[-1][1] >= limits.min_latency_samples
        return cls(
            running=w.per_replica(w.running),
            waiting=w.per_replica(w.waiting),
            kv_usage=w.kv_cache_usage,
            kv_peak=w.kv_cache_usage_peak,
            thrash=max(w.per_replica(w.preemptions_per_minute), w.per_replica(w.swaps_per_minute)),
            itl_p99=w.itl_p99 if enough else None,
        )


def decide_tuning(
    window: Window | None,
    spec: TuningSpec,
    settings: EngineSettings,
    now: float,
    history: Sequence[TuneRecord] = (),
    limits: TuneLimits = TuneLimits(),
) -> TuneDecision:
    def hold(reason: str, inputs: dict | None = None) -> TuneDecision:
        return TuneDecision(
            "hold", settings.max_num_seqs, settings.kv_cache_dtype, reason, inputs or {}
        )

    if not spec.enabled:
        return hold("tuning disabled")
    previous = last_change(history)
    if previous is not None and now - previous.time < spec.cooldown_seconds:
        left = spec.cooldown_seconds - (now - previous.time)
        return hold(f"cooldown: {left:.0f} s left after the last {previous.kind}")
    if window is None or window.replicas == 0:
        return hold("no metrics")
    inputs = inputs_of(window, settings)
    if window.span_seconds < limits.min_window_seconds:
        return hold(f"observing: {window.span_seconds:.0f} s of metrics so far", inputs)
    law = _Law(spec, settings, Signals.of(window, limits), limits, inputs)
    return law.memory() or law.latency() or law.kv_full() or law.slots(history, now)


@dataclass(frozen=True)
class _Law:
    """The rules in priority order; each returns a decision, or None when it does not apply."""

    spec: TuningSpec
    settings: EngineSettings
    s: Signals
    limits: TuneLimits
    inputs: dict

    def _decided(self, kind: Kind, reason: str, mns: int | None = None, dtype: str | None = None):
        return TuneDecision(
            kind,
            self.settings.max_num_seqs if mns is None else mns,
            dtype or self.settings.kv_cache_dtype,
            reason,
            self.inputs,
        )

    @property
    def fp8_allowed(self) -> bool:
        return self.spec.allow_fp8_kv_cache and not is_fp8(self.settings.kv_cache_dtype)

    def _fp8(self, why: str) -> TuneDecision:
        return self._decided(
            "fp8", f"{why}: KV cache {self.settings.kv_cache_dtype} -> fp8", dtype=FP8
        )

    def _lower(self, why: str) -> TuneDecision:
        mns, lo = self.settings.max_num_seqs, self.spec.max_num_seqs.min
        batch = min(mns, self.s.running)  # max_num_seqs above the running batch changes nothing
        new = max(lo, min(mns - 1, math.floor(batch * self.limits.lower_factor)))
        if new >= mns:
            return self._decided("hold", f"{why}; max_num_seqs is at its minimum {lo}")
        return self._decided("lower", f"{why}: max_num_seqs {mns} -> {new}", mns=new)

    def memory(self) -> TuneDecision | None:
        if self.s.thrash <= self.limits.thrash_per_minute:
            return None
        mns = self.settings.max_num_seqs
        if self.s.running > mns:  # a lower never evicts: the old batch is still finishing
            return self._decided(
                "hold",
                f"thrashing, but {self.s.running:.1f} running over the new limit {mns}: draining",
            )
        why = (
            f"memory-bound: {self.s.thrash:.1f} preemptions or swaps per minute per replica "
            f"(bound {self.limits.thrash_per_minute:g})"
        )
        return self._fp8(why) if self.fp8_allowed else self._lower(why)

    def latency(self) -> TuneDecision | None:
        itl, target = self.s.itl_p99, self.spec.target_inter_token_latency_seconds
        if itl is None or itl <= target:
            return None
        return self._lower(
            f"latency-bound: ITL P99 {itl * 1000:.0f} ms over the {target * 1000:.0f} ms target"
        )

    def kv_full(self) -> TuneDecision | None:
        s = self.s
        if s.kv_usage < self.limits.kv_full or s.waiting < self.limits.min_waiting:
            return None
        why = f"KV cache {s.kv_usage:.0%} full with {s.waiting:.1f} waiting per replica"
        if self.fp8_allowed:
            return self._fp8(why)
        return self._decided(
            "hold", f"{why}: fp8 not allowed or on, and fewer slots would not add room"
        )

    def slots(self, history: Sequence[TuneRecord], now: float) -> TuneDecision:
        s, mns, lim = self.s, self.settings.max_num_seqs, self.limits
        target = self.spec.target_inter_token_latency_seconds
        if s.running < lim.slot_busy_fraction * mns or s.waiting < lim.min_waiting:
            return self._decided(
                "hold",
                f"not slot-bound: {s.running:.1f} of {mns} slots busy, {s.waiting:.1f} waiting",
            )
        if s.thrash > 0:
            return self._decided(
                "hold",
                f"slot-bound but {s.thrash:.1f} preemptions or swaps per minute: not raising",
            )
        if s.itl_p99 is not None and s.itl_p99 > lim.latency_headroom * target:
            return self._decided(
                "hold",
                f"slot-bound but ITL P99 {s.itl_p99 * 1000:.0f} ms leaves no headroom under "
                f"the {target * 1000:.0f} ms target",
            )
        new = _raised(mns, s.running, s.kv_peak, self.spec.max_num_seqs.max, lim)
        ceiling = raise_ceiling(history, self.settings.kv_cache_dtype, now, lim.memory_seconds)
        if ceiling < new:
            new = int(ceiling)
        too_small = new < mns * (1 + lim.min_raise_fraction) and new < self.spec.max_num_seqs.max
        if new <= mns or too_small:
            at = (
                "its bound"
                if new >= self.spec.max_num_seqs.max
                else "a recently lowered value or the KV cache's room"
            )
            return self._decided("hold", f"slot-bound but max_num_seqs {mns} is at {at}")
        return self._decided(
            "raise",
            f"slot-bound: {s.running:.1f} of {mns} slots busy, {s.waiting:.1f} waiting, "
            f"KV {s.kv_usage:.0%}: max_num_seqs {mns} -> {new}",
            mns=new,
        )


def _raised(mns: int, running: float, kv_peak: float, hi: int, limits: TuneLimits) -> int:
    """Double at most, and no further than the KV cache holds at the window's peak usage
    per running sequence (sequences grow: the mean would promise room that fills later)."""
    new = math.ceil(mns * limits.raise_factor)
    if kv_peak > 0 and running > 0:
        new = min(new, math.floor(running * limits.kv_raise_bound / kv_peak))
    return min(hi, new)


def record(decision: TuneDecision, previous_max_num_seqs: int, now: float) -> TuneRecord:
    return TuneRecord(
        time=now,
        kind=decision.kind,
        max_num_seqs=decision.max_num_seqs,
        previous_max_num_seqs=previous_max_num_seqs,
        kv_cache_dtype=decision.kv_cache_dtype,
        reason=decision.reason,
    )
