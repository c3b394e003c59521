"""The tuner's control law: which engine change to try next, and the verdict on the one on
trial. Pure: no I/O, no clock; the tuner's memory comes in as a ``TunerState``.

Every change is an experiment (experiment.py has the rule): tried, judged on goodput
against a baseline, kept or reverted, and remembered. With two or more replicas a live
change (max_num_seqs, max_num_batched_tokens) runs on one replica first, a canary judged
against the others in the same window, and reaches all only if it won. A change of KV dtype
restarts pods, so it runs on every replica and is judged against the window before it.

What to try comes from the seed document's manual rules (§4.1, §5.1, §6), on the worst
replica (an average would hide one thrashing or slow replica of four):
- memory-bound (preemptions or swaps per 1,000 generated tokens over a bound, a figure
  that means the same on a CPU and on a GPU serving a hundred times the tokens): fp8 when
  allowed, else a lower max_num_seqs;
- ITL P99 over its target: a lower step budget (less prefill between two decode tokens)
  when TTFT has headroom, and a lower max_num_seqs;
- TTFT P99 over its target with ITL headroom: a higher step budget;
- KV cache full with a queue: fp8 when allowed;
- slot-bound (slots busy, a queue, no thrash, ITL headroom): a higher max_num_seqs, no
  further than the KV cache holds at today's usage per sequence;
- fp8 on while the KV cache would fit in 16 bits: back to the spec's dtype;
- LoRA-bound (MaxLorasBottleneck: requests wait for adapters that find every LoRA slot
  taken while batch slots are free, over most of the window): a higher max_loras within
  tuning.maxLoras (a rolling restart); at the bound the tuner holds and says so, and the
  autoscaler, which counts those requests as queue, scales out.
The first candidate that no verdict forbids is tried. A rejected one is not tried again
for a while that doubles with each rejection, so no rule can walk a setting down for good.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from batchpilot.operator.crd import InferenceServiceSpec
from batchpilot.operator.loop.judge import Targets, judge, misses_slo, score
from batchpilot.operator.loop.observe import Window, histogram_quantile, merge_windows
from batchpilot.operator.loop.tuner_state import (
    EngineSettings,
    Experiment,
    Kind,
    Move,
    TuneDecision,
    TunerState,
    is_fp8,
)

FP8 = "fp8"
LIVE_KINDS = ("raise", "lower", "raise_budget", "lower_budget")


@dataclass(frozen=True)
class TuneLimits:
    """The law's thresholds. Not in the CRD: they describe the engine, not a workload."""

    thrash_per_1k_tokens: float = 1.0  # preemptions or swaps per 1,000 generated tokens
    slot_busy_fraction: float = 0.85  # running >= this x max_num_seqs is "all slots busy"
    min_waiting: float = 0.5  # mean waiting per replica that counts as a queue
    kv_raise_bound: float = 0.85  # a raise stops where KV usage would reach this
    kv_full: float = 0.95  # KV usage that counts as full
    fp8_off_kv_peak: float = 0.4  # with fp8 on, a peak under this would fit in 16 bits
    latency_headroom: float = 0.8  # a higher step budget only with ITL P99 under this x target
    raise_factor: float = 2.0  # most a raise multiplies max_num_seqs by
    min_raise_fraction: float = 0.1  # a smaller raise is not worth an experiment
    lower_factor: float = 0.75  # a lower sets max_num_seqs to this x the running batch
    budget_factor: float = 2.0  # a budget change multiplies or divides by this
    min_window_seconds: float = 30.0  # least observation behind a baseline or a verdict
    # A P99 over fewer gaps is the window's few worst steps (one long prefill): noise, not
    # a latency level. Below this many ITL observations the latency rules do not fire.
    min_p99_samples: int = 500
    # A baseline or a verdict rests on shares within the targets and on rates, which
    # settle sooner; below this many ITL observations nothing is tried or judged (200
    # gaps in a 60 s window: a replica generating 3.4 tokens/s can still be tuned).
    min_latency_samples: int = 200
    max_experiment_seconds: float = 900.0  # without evidence by then, the trial is dropped
    retry_seconds: float = 900.0  # a rejected setting waits this, doubled per rejection
    max_retry_seconds: float = 4 * 3600.0
    outlier_factor: float = 2.0  # ITL P99 over this x the others' median: an outlier
    lora_bottleneck_share: float = 0.5  # of the window's scrapes LoRA-bound (LoraInfo)
    lora_raise_factor: float = 2.0  # a max_loras raise multiplies it by this


@dataclass(frozen=True)
class Signals:
    """The window reduced to what the rules compare: queue and batch per replica, the
    worst replica's memory pressure and latencies, and which replicas stand out."""

    running: float
    waiting: float
    kv_usage: float
    kv_peak: float
    thrash: float  # preemptions or swaps per 1,000 generated tokens, worst replica
    itl_p99: float | None  # worst replica with enough observations
    ttft_p99: float | None
    outliers: tuple[str, ...] = ()
    lora_bottleneck: float = 0.0  # share of the window's scrapes LoRA-bound

    @classmethod
    def of(cls, service: Window, replicas: dict[str, Window], limits: TuneLimits) -> Signals:
        itls = {
            u: histogram_quantile(0.99, w.itl_buckets)
            for u, w in replicas.items()
            if w.itl_buckets and w.itl_buckets[-1][1] >= limits.min_p99_samples / len(replicas)
        }
        itls = {u: v for u, v in itls.items() if v is not None}
        ttfts = [w.ttft_p99 for w in replicas.values() if w.ttft_p99 is not None]
        return cls(
            running=service.per_replica(service.running),
            waiting=service.per_replica(service.waiting),
            kv_usage=service.kv_cache_usage,
            kv_peak=service.kv_cache_usage_peak,
            thrash=max((thrash_per_1k(w) for w in replicas.values()), default=0.0),
            itl_p99=max(itls.values(), default=None),
            ttft_p99=max(ttfts, default=None),
            outliers=outliers(itls, limits.outlier_factor),
            lora_bottleneck=service.lora_bottleneck,
        )


def thrash_per_1k(w: Window) -> float:
    events = max(w.preemptions_per_minute, w.swaps_per_minute) / 60
    tokens = w.generation_tokens_per_second
    if tokens <= 0:
        return math.inf if events > 0 else 0.0
    return 1000 * events / tokens


def outliers(itls: dict[str, float], factor: float) -> tuple[str, ...]:
    """Replicas whose ITL P99 is over ``factor`` x the median of the others'."""
    out = []
    for url, value in itls.items():
        others = [v for u, v in itls.items() if u != url]
        if others and value > factor * statistics.median(others):
            out.append(url)
    return tuple(sorted(out))


@dataclass(frozen=True)
class Candidate:
    kind: Kind
    settings: EngineSettings
    reason: str


def inputs_of(s: Signals, service: Window, settings: EngineSettings) -> dict:
    """What the decision saw, for status and Events."""
    out = {
        "replicas": service.replicas,
        "windowSeconds": round(service.span_seconds, 1),
        **settings.to_status(),
        "runningPerReplica": round(s.running, 2),
        "waitingPerReplica": round(s.waiting, 2),
        "kvCacheUsage": round(s.kv_usage, 3),
        "thrashPer1kTokensWorstReplica": round(s.thrash, 3) if math.isfinite(s.thrash) else "inf",
    }
    if s.itl_p99 is not None:
        out["itlP99SecondsWorstReplica"] = round(s.itl_p99, 4)
    if s.ttft_p99 is not None:
        out["ttftP99SecondsWorstReplica"] = round(s.ttft_p99, 4)
    if s.outliers:
        out["outlierReplicas"] = list(s.outliers)
    if s.lora_bottleneck:
        out["loraBottleneckShare"] = round(s.lora_bottleneck, 3)
    return out


@dataclass(frozen=True)
class Rules:
    """The candidates in priority order, for one window."""

    spec: InferenceServiceSpec
    settings: EngineSettings
    s: Signals
    limits: TuneLimits
    targets: Targets

    def candidates(self) -> list[Candidate]:
        return [
            *self.memory(),
            *self.latency(),
            *self.first_token(),
            *self.kv_full(),
            *self.loras(),
            *self.slots(),
            *self.fp8_off(),
        ]

    # -- moves

    def _with(self, **changes) -> EngineSettings:
        return replace(self.settings, **changes)

    def _fp8(self, why: str) -> list[Candidate]:
        if not self.spec.tuning.allow_fp8_kv_cache or is_fp8(self.settings.kv_cache_dtype):
            return []
        dtype = self.settings.kv_cache_dtype
        return [Candidate("fp8", self._with(kv_cache_dtype=FP8), f"{why}: KV cache {dtype} -> fp8")]

    def _lower(self, why: str) -> list[Candidate]:
        mns, lo = self.settings.max_num_seqs, self.spec.tuning.max_num_seqs.min
        batch = min(mns, self.s.running)  # max_num_seqs above the running batch changes nothing
        new = max(lo, min(mns - 1, math.floor(batch * self.limits.lower_factor)))
        if new >= mns:
            return []
        return [
            Candidate("lower", self._with(max_num_seqs=new), f"{why}: max_num_seqs {mns} -> {new}")
        ]

    def _budget(self, kind: Kind, why: str) -> list[Candidate]:
        bounds = self.spec.tuning.max_num_batched_tokens
        budget = self.settings.max_num_batched_tokens
        if bounds is None or budget is None:
            return []
        f = self.limits.budget_factor
        new = math.ceil(budget * f) if kind == "raise_budget" else math.floor(budget / f)
        # A step holds one token of every running sequence.
        new = max(bounds.min, self.settings.max_num_seqs, min(bounds.max, new))
        moved = new > budget if kind == "raise_budget" else new < budget
        if not moved or new > bounds.max:
            return []
        return [
            Candidate(
                kind,
                self._with(max_num_batched_tokens=new),
                f"{why}: max_num_batched_tokens {budget} -> {new}",
            )
        ]

    # -- rules

    def memory(self) -> list[Candidate]:
        if self.s.thrash <= self.limits.thrash_per_1k_tokens:
            return []
        if self.s.running > self.settings.max_num_seqs:
            return []  # a lower never evicts: the old, larger batch is still finishing
        why = (
            f"memory-bound: {self.s.thrash:.2f} preemptions or swaps per 1,000 tokens on the "
            f"worst replica (bound {self.limits.thrash_per_1k_tokens:g})"
        )
        return self._fp8(why) + self._lower(why)

    def latency(self) -> list[Candidate]:
        itl, target = self.s.itl_p99, self.targets.itl_seconds
        if itl is None or itl <= target:
            return []
        why = f"ITL P99 {itl * 1000:.0f} ms over the {target * 1000:.0f} ms target"
        ttft = self.s.ttft_p99
        budget_first = ttft is not None and ttft < 0.5 * self.targets.ttft_seconds
        lower_budget = self._budget("lower_budget", why)
        lower = self._lower(why)
        return lower_budget + lower if budget_first else lower + lower_budget

    def first_token(self) -> list[Candidate]:
        ttft, itl = self.s.ttft_p99, self.s.itl_p99
        if ttft is None or ttft <= self.targets.ttft_seconds:
            return []
        if itl is not None and itl > self.limits.latency_headroom * self.targets.itl_seconds:
            return []
        why = f"TTFT P99 {ttft:.2f} s over the {self.targets.ttft_seconds:g} s target"
        return self._budget("raise_budget", why)

    def kv_full(self) -> list[Candidate]:
        s = self.s
        if s.kv_usage < self.limits.kv_full or s.waiting < self.limits.min_waiting:
            return []
        return self._fp8(f"KV cache {s.kv_usage:.0%} full with {s.waiting:.1f} waiting per replica")

    def slots(self) -> list[Candidate]:
        s, mns, lim = self.s, self.settings.max_num_seqs, self.limits
        if s.running < lim.slot_busy_fraction * mns or s.waiting < lim.min_waiting:
            return []
        if s.thrash > 0:
            return []
        # No ITL headroom asked: over its target, the latency rule's lowers come first, and
        # if they were rejected (the ITL came from the queue's prefills, not the batch) a
        # raise is the next hypothesis; its trial shows whether latency allows it.
        hi = self.spec.tuning.max_num_seqs.max
        if self.settings.max_num_batched_tokens is not None:
            hi = min(hi, self.settings.max_num_batched_tokens)  # one token each per step
        new = _raised(mns, s.running, s.kv_peak, hi, lim)
        if new < mns * (1 + lim.min_raise_fraction) and new < self.spec.tuning.max_num_seqs.max:
            return []
        if new <= mns:
            return []
        why = (
            f"slot-bound: {s.running:.1f} of {mns} slots busy, {s.waiting:.1f} waiting, "
            f"KV {s.kv_usage:.0%}: max_num_seqs {mns} -> {new}"
        )
        return [Candidate("raise", self._with(max_num_seqs=new), why)]

    def lora_bound(self) -> str | None:
        """Why max_loras is the bottleneck (MaxLorasBottleneck), or None."""
        share = self.s.lora_bottleneck
        if self.spec.tuning.max_loras is None or share < self.limits.lora_bottleneck_share:
            return None
        return (
            f"MaxLorasBottleneck: in {share:.0%} of the window requests waited for adapters "
            f"with all {self.settings.max_loras} LoRA slots taken and batch slots free"
        )

    def loras(self) -> list[Candidate]:
        why, bounds, now = self.lora_bound(), self.spec.tuning.max_loras, self.settings.max_loras
        if why is None or bounds is None or now is None:
            return []
        new = min(bounds.max, math.ceil(now * self.limits.lora_raise_factor))
        if new <= now:
            return []  # at the bound: _propose holds and says so; the autoscaler scales out
        return [
            Candidate("raise_loras", self._with(max_loras=new), f"{why}: max_loras {now} -> {new}")
        ]

    def fp8_off(self) -> list[Candidate]:
        dtype, default = self.settings.kv_cache_dtype, self.spec.engine.kv_cache_dtype
        if not is_fp8(dtype) or is_fp8(default) or self.s.thrash > 0:
            return []
        if (
            self.s.kv_peak >= self.limits.fp8_off_kv_peak
            or self.s.waiting >= self.limits.min_waiting
        ):
            return []
        why = (
            f"KV cache peak {self.s.kv_peak:.0%} in fp8 would fit in 16 bits: {dtype} -> {default}"
        )
        return [Candidate("fp8_off", self._with(kv_cache_dtype=default), why)]


def _raised(mns: int, running: float, kv_peak: float, hi: int, limits: TuneLimits) -> int:
    """Double at most, and no further than the KV cache holds at the window's peak usage
    per running sequence (sequences grow: the mean would promise room that fills later)."""
    new = math.ceil(mns * limits.raise_factor)
    if kv_peak > 0 and running > 0:
        held = running * limits.kv_raise_bound / kv_peak
        if math.isfinite(held):  # a vanishing peak (a denormal) bounds nothing
            new = min(new, math.floor(held))
    return min(hi, new)


# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class View:
    """What the tuner sees this turn. ``service``: every replica since the last change,
    running the settings in force; ``replicas``: each replica since the experiment began
    (or the last change), with the settings it reports."""

    service: Window | None
    replicas: dict[str, Window]


def targets_of(spec: InferenceServiceSpec) -> Targets:
    return Targets(spec.ttft_target_seconds, spec.itl_target_seconds)


def runs(w: Window, url: str, settings: EngineSettings) -> bool:
    """Does this replica report running ``settings``? (Unknown values count as yes.)"""
    mns = w.max_num_seqs.get(url)
    dtype = w.kv_cache_dtype.get(url)
    budget = w.max_num_batched_tokens.get(url)
    loras = w.max_loras.get(url)
    return (
        (mns is None or mns == settings.max_num_seqs)
        and (dtype is None or dtype == settings.kv_cache_dtype)
        and (budget is None or settings.max_num_batched_tokens is None
             or budget == settings.max_num_batched_tokens)
        and (loras is None or settings.max_loras is None or loras == settings.max_loras)
    )  # fmt: skip


def decide_tuning(
    view: View,
    spec: InferenceServiceSpec,
    state: TunerState,
    in_force: EngineSettings,
    now: float,
    limits: TuneLimits = TuneLimits(),
) -> tuple[TuneDecision, TunerState]:
    """This turn's decision and the tuner's state after it."""
    settings = state.settings or in_force
    if state.experiment is not None:
        return _judge(view, spec, state, settings, now, limits)
    return _propose(view, spec, state, settings, now, limits)


def _hold(state: TunerState, settings: EngineSettings, why: str, now: float, inputs=None):
    d = TuneDecision("hold", settings, why, now, inputs=inputs or {})
    return d, state.decided(d, state.experiment)


def _propose(view, spec, state, settings, now, limits):
    window = view.service
    last = state.last_change
    if last is not None and now - last < spec.tuning.cooldown_seconds:
        left = spec.tuning.cooldown_seconds - (now - last)
        return _hold(state, settings, f"cooldown: {left:.0f} s left after the last change", now)
    if window is None or window.replicas == 0:
        return _hold(state, settings, "no metrics", now)
    signals = Signals.of(window, view.replicas, limits)
    inputs = inputs_of(signals, window, settings)
    if window.span_seconds < limits.min_window_seconds:
        why = f"observing: {window.span_seconds:.0f} s of metrics so far"
        return _hold(state, settings, why, now, inputs)
    targets = targets_of(spec)
    baseline = score(window, targets)
    if baseline.samples < limits.min_latency_samples:
        why = f"too little traffic to judge a change: {baseline.samples} ITL observations"
        return _hold(state, settings, why, now, inputs)
    candidates = Rules(spec, settings, signals, limits, targets).candidates()
    load = signals.running + signals.waiting
    for c in candidates:
        if state.blocked(Move(settings, c.kind), now, load) is None:
            return _start(view, state, settings, c, baseline, targets, now, inputs)
    if candidates:
        v = state.blocked(Move(settings, candidates[0].kind), now, load)
        why = (
            f"{candidates[0].reason}, but that was tried and rejected {v.strikes} time(s) in a row"
        )
        return _hold(state, settings, why, now, inputs)
    rules = Rules(spec, settings, signals, limits, targets)
    if (lora_bound := rules.lora_bound()) is not None:
        why = f"{lora_bound}, and max_loras is at tuning.maxLoras.max: scaling out is the autoscaler's"
        return _hold(state, settings, why, now, inputs)
    return _hold(state, settings, "no rule applies: holding", now, inputs)


def _start(view, state, settings, c: Candidate, baseline, targets, now, inputs):
    answered = sorted(view.replicas)
    canary = answered[0] if c.kind in LIVE_KINDS and len(answered) >= 2 else None
    experiment = Experiment(
        kind=c.kind, before=settings, after=c.settings, started=now, reason=c.reason,
        baseline=None if canary else baseline, canary=canary,
        slo_missed=misses_slo(baseline, targets),
    )  # fmt: skip
    action = "canary" if canary else "try"
    in_force = settings if canary else c.settings
    where = f" on {canary}, against the other replicas" if canary else ""
    d = TuneDecision(
        action, in_force, f"trying{where}: {c.reason}", now, c.kind, baseline, None, inputs
    )
    return d, state.decided(d, experiment)


def _judge(view, spec, state, settings, now, limits):
    e = state.experiment
    targets = targets_of(spec)
    if e.canary is not None:
        trial = view.replicas.get(e.canary)
        control = merge_windows([w for u, w in view.replicas.items() if u != e.canary])
        if trial is None or control is None:
            return _end(
                state,
                e,
                "abandon",
                "the canary or every other replica stopped answering",
                now,
                limits,
            )
        if not runs(trial, e.canary, e.after):
            return _end(
                state,
                e,
                "abandon",
                "the canary does not run the change (apply failed)",
                now,
                limits,
            )
        before, after = score(control, targets), score(trial, targets)
    else:
        ran = [w for u, w in view.replicas.items() if runs(w, u, e.after)]
        window = merge_windows(ran)
        if window is None:
            return _waiting(state, e, settings, "no replica runs the change yet", now, limits)
        before, after = e.baseline, score(window, targets)
        trial = window
    if after.samples == 0 and trial.span_seconds >= 2 * limits.min_window_seconds:
        # The traffic stopped: no verdict can come, and a trial on hold freezes scale-downs.
        return _end(state, e, "abandon", "no traffic since it began", now, limits)
    if trial.span_seconds < limits.min_window_seconds or after.samples < limits.min_latency_samples:
        why = f"{after.samples} ITL observations over {trial.span_seconds:.0f} s so far"
        return _waiting(state, e, settings, why, now, limits)
    keep, why = judge(
        before, after, targets, slo_missed=e.slo_missed or misses_slo(before, targets),
        toward_default=e.kind == "fp8_off",
    )  # fmt: skip
    return _end(state, e, "keep" if keep else "revert", why, now, limits, before, after)


def _waiting(state, e: Experiment, settings, why: str, now: float, limits: TuneLimits):
    if now - e.started > limits.max_experiment_seconds:
        return _end(
            state, e, "abandon", f"no verdict after {now - e.started:.0f} s: {why}", now, limits
        )
    return _hold(state, settings, f"judging {e.kind}: {why}", now)


def _retry(limits: TuneLimits) -> tuple[float, float]:
    return limits.retry_seconds, limits.max_retry_seconds


def _end(state, e: Experiment, verdict: str, why: str, now, limits, before=None, after=None):
    """Keep (rolling a canary's change out to every replica), revert or abandon."""
    load = before.load if before is not None else None
    if verdict == "keep":
        action = "rollout" if e.canary else "keep"
        settings, reason = e.after, f"kept {e.kind}: {why}"
        state = state.judged(Move(e.before, e.kind), True, now, *_retry(limits), load)
    elif verdict == "revert":
        action, settings, reason = "revert", e.before, f"reverted {e.kind}: {why}"
        state = state.judged(Move(e.before, e.kind), False, now, *_retry(limits), load)
    else:
        action, settings, reason = "abandon", e.before, f"abandoned {e.kind}: {why}"
    d = TuneDecision(action, settings, reason, now, e.kind, before, after)
    return d, state.decided(d, None)
