"""The tuner's control law: which engine change to try next, and the verdict on the one on
trial. Pure: no I/O, no clock; the tuner's memory comes in as a ``TunerState``.

Every change is an experiment (judge.py has the rule): tried, judged on goodput
against a baseline, kept or reverted, and remembered. With two or more replicas a live
change (max_num_seqs, max_num_batched_tokens) runs on one replica first, a canary judged
against the others in the same window, and reaches all only if it won. A change of KV dtype
restarts pods, so it runs on every replica and is judged against the window before it.

What to try comes from the seed document's manual rules (§4.1, §5.1, §6; tune_rules.py),
on the worst replica (an average would hide one thrashing or slow replica of four):
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

from dataclasses import dataclass

from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.loop.judge import Targets, judge, misses_slo, score
from batchpilot.operator.loop.observe import Window, merge_windows
from batchpilot.operator.loop.state import TunerState
from batchpilot.operator.loop.tune_rules import (
    Candidate,
    Rules,
    Signals,
    TuneLimits,
    inputs_of,
)
from batchpilot.operator.loop.tuner_state import EngineSettings, Experiment, Move, TuneDecision

LIVE_KINDS = ("raise", "lower", "raise_budget", "lower_budget")


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
