"""Guardrails: moves made at once, with no trial, and only in the safe direction.

- Queue: requests waited in this turn and the one before with every slot busy, and no
  memory thrash: raise max_num_seqs at once to the safe cap, the model's plan (its latency
  and KV caps), or room for the whole queue (at least twice today's value) before the
  model can speak; until the model knows the KV cache's size, never past what the cache
  held at the window's peak usage per sequence (then the model's KV cap bounds it: a full
  cache at its peak is what a KV-bound replica always shows, and the peak's bound kept
  the simulator's KV-bound CPU cells at 16 slots where 18 served 7 % more). Past the
  plan when the replica is overloaded at it (the queue grows there, or the demand is
  more than the plan completes) and the queue is a backlog (its oldest
  request has waited 1.5 x the TTFT target): then queued requests miss their TTFT at any
  batch, a larger loss than a TPOT over target, so the cap is the model's KV cap (room
  for the queue while the KV cache is unknown), within the model's reach (twice the
  largest batch it has seen: a plant that is not the model's form may slow down past
  it). Where clients give up before their TTFT target the queue stays young, and a batch
  past the plan would only cost its own requests' TPOT. A raise made on a queue is undone
  only by the thrash or latency guardrail, never by a goodput window. The queue is the
  last turn's, so a long quiet spell does not average it away. On a plant the model
  found slower (PlantDegraded) the plan is the old machine's: the raise makes room for
  steps that many times as long, bounded by the KV cap, once per episode (tune.py).
- KV thrash (preemptions or swaps per 1,000 generated tokens over a bound, worst replica):
  fp8 when allowed, else lower to the count the KV cache holds (the model's KV cap, else
  the window's peak), at most halving.
- Latency: fewer than ``latency_attainment`` of the window's requests met the TPOT target,
  and the model attributes it to the batch (its mean step at the running batch misses the
  target, and at the latency cap its TPOT is at least the planner's MIN_RELIEF less), on a
  healthy plant with no backlog, no growing queue and no queue draining (a backlog
  drains slower after a lower, and while it drains the batch is its, not the demand's):
  lower to the latency cap, at most halving. A young queue does not hold it: the
  queue guardrail raises no further than the plan the lower leads to. Not while an
  overload raise binds (``overload_after``): the raise past the plan is remembered, and
  the lower waits until the overload has been gone (the arrival rate within the plan's
  capacity, no queue) for ``overload_clear_seconds``; else the two took turns, 32 <-> 64
  every 30-60 s on a diurnal peak. A lower with no overload raise before
  it (a TPOT target no batch can meet, a genuine latency breach) is not held.
- LoRA-bound (MaxLorasBottleneck): a higher max_loras within tuning.maxLoras.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.loop.model_state import ModelState
from batchpilot.operator.loop.observe import Window
from batchpilot.operator.loop.planner import MIN_RELIEF, Plan, relief, tpot_mean
from batchpilot.operator.loop.plant import Fit
from batchpilot.operator.loop.tuner_state import EngineSettings, Kind, OverloadRaise, is_fp8
from batchpilot.operator.loop.verify import share_within

FP8 = "fp8"


@dataclass(frozen=True)
class TuneLimits:
    """The loop's thresholds. Not in the CRD: they describe the engine, not a workload."""

    thrash_per_1k_tokens: float = 1.0  # preemptions or swaps per 1,000 generated tokens
    slot_busy_fraction: float = 0.85  # running >= this x max_num_seqs is "all slots busy"
    min_waiting: float = 0.5  # mean waiting per replica that counts as a queue
    kv_raise_bound: float = 0.85  # a raise stops where KV usage would reach this (no KV cap)
    fp8_off_kv_peak: float = 0.4  # with fp8 on, a peak under this would fit in 16 bits
    min_window_seconds: float = 30.0  # least observation behind any decision
    max_lower_fraction: float = 0.5  # one lower keeps at least this share of max_num_seqs
    latency_attainment: float = 0.9  # TPOT share under which the latency guardrail looks
    min_latency_requests: int = 20  # finished requests before it may
    dwell_seconds: float = 600.0  # no planned change sooner after any change
    planned_per_hour: int = 2
    replan_seconds: float = 6 * 3600.0  # a drift check without a change point
    lora_bottleneck_share: float = 0.5  # of the window's scrapes LoRA-bound (LoraInfo)
    lora_raise_factor: float = 2.0
    # An overload raise binds until the overload has been gone this long (the dwell of a
    # planned change: a demand near the plan's capacity crosses it back and forth).
    overload_clear_seconds: float = 600.0
    # A queue whose oldest request has waited this x the TTFT target is a backlog (clients
    # that give up at the target keep it under: a step's length past it at most).
    backlog_ttft_factor: float = 1.5


@dataclass(frozen=True)
class Candidate:
    kind: Kind
    settings: EngineSettings
    reason: str
    # An overload raise past the plan: the plan's max_num_seqs it went past (else None).
    past_plan: int | None = None


def thrash_per_1k(w: Window) -> float:
    events = max(w.preemptions_per_minute, w.swaps_per_minute) / 60
    tokens = w.generation_tokens_per_second
    if tokens <= 0:
        return math.inf if events > 0 else 0.0
    return 1000 * events / tokens


def worst_thrash(replicas: dict[str, Window]) -> float:
    return max((thrash_per_1k(w) for w in replicas.values()), default=0.0)


def _floor(mns: int, spec: InferenceServiceSpec, limits: TuneLimits) -> int:
    return max(spec.tuning.max_num_seqs.min, math.ceil(limits.max_lower_fraction * mns))


def thrash(
    w: Window, replicas: dict[str, Window], s: EngineSettings, spec: InferenceServiceSpec,
    limits: TuneLimits, plan: Plan | None = None,
) -> Candidate | None:  # fmt: skip
    worst = worst_thrash(replicas)
    running = w.per_replica(w.running)
    if worst <= limits.thrash_per_1k_tokens or running > s.max_num_seqs:
        return None  # over max_num_seqs: a lower's old, larger batch is still finishing
    why = f"KV thrash: {worst:.2f} preemptions or swaps per 1,000 tokens (bound {limits.thrash_per_1k_tokens:g})"
    if spec.tuning.allow_fp8_kv_cache and not is_fp8(s.kv_cache_dtype):
        return Candidate("fp8", replace(s, kv_cache_dtype=FP8), f"{why}: KV cache -> fp8")
    # The KV-safe count: the model's KV cap (a sequence's mean occupancy), else what the
    # cache held at the window's peak. A cap at or over today's: the thrash came from the
    # tail of the lengths, and a lower would cost more than the swaps.
    held = math.floor(running * limits.kv_raise_bound / max(w.kv_cache_usage_peak, 1e-9))
    safe = plan.kv_cap if plan is not None and plan.kv_cap is not None else held
    if safe >= s.max_num_seqs:
        return None
    new = max(_floor(s.max_num_seqs, spec, limits), min(s.max_num_seqs - 1, safe))
    if new >= s.max_num_seqs:
        return None
    return Candidate(
        "lower", replace(s, max_num_seqs=new), f"{why}: max_num_seqs {s.max_num_seqs} -> {new}"
    )


def overloaded(s: EngineSettings, model: ModelState, plan: Plan | None) -> bool:
    """The plan cannot keep up: the demand is more requests a second than it completes
    within the SLO, or the queue grows at it."""
    if plan is None:
        return False
    at_plan = s.max_num_seqs >= plan.max_num_seqs
    return model.per_replica().rate > plan.capacity or (at_plan and model.queue_growing())


def backlog(w: Window, spec: InferenceServiceSpec, limits: TuneLimits) -> bool:
    """The queue's oldest request has waited well past the TTFT target: queued requests
    miss it at any batch, and only throughput drains them."""
    return w.oldest_waiting_seconds > limits.backlog_ttft_factor * spec.ttft_target_seconds


def draining(w: Window, model: ModelState, limits: TuneLimits) -> bool:
    """The window's queue is draining: it queued on average, and the latest turn queues
    less. Its requests ran in a batch the backlog filled, past the one the demand keeps
    running, so their TPOTs are the drain's, not the setting's (W7 on the CPU: 64 -> 32
    -> 23 once a neighbour's backlog drained, and back to 64 when the next one came)."""
    queued = w.per_replica(w.waiting)
    return queued >= limits.min_waiting and bool(model.queue) and model.queue[-1] < queued


def safe_cap(w: Window, s: EngineSettings, spec: InferenceServiceSpec, plan: Plan | None,
             limits: TuneLimits, overload: bool = False, slower: float = 1.0) -> int:  # fmt: skip
    """The highest max_num_seqs the loop may raise to at once. ``slower``: a degraded
    plant's step over the model's (ModelState.slower)."""
    running = w.per_replica(w.running)
    # Room for the whole queue at once, at least twice today's: a second raise would come
    # a turn and a longer queue later.
    room = max(2 * s.max_num_seqs, math.ceil(running + w.per_replica(w.waiting)))
    if slower > 1:
        # The plan and its reach are the old machine's. As many sequences as keep the
        # tokens a second where steps take ``slower`` times as long, in one raise: the
        # queue a neighbour builds grows at any batch, and each doubling that chased it
        # was another change inside the incident (W7 from under: 16 -> 32 -> 64 in 30 s).
        cap = max(room, math.ceil(s.max_num_seqs * slower))
        if plan is not None and plan.kv_cap is not None:
            cap = min(cap, plan.kv_cap)
    elif plan is None:
        cap = room
    elif overload:  # within the model's reach: past it a mismatched plant may slow down
        cap = min(room if plan.kv_cap is None else plan.kv_cap, max(plan.reach, plan.max_num_seqs))
    else:
        cap = plan.max_num_seqs
    if (plan is None or plan.kv_cap is None) and w.kv_cache_usage_peak > 0 and running > 0:
        held = running * limits.kv_raise_bound / w.kv_cache_usage_peak
        if math.isfinite(held):
            cap = min(cap, math.floor(held))
    cap = min(cap, spec.tuning.max_num_seqs.max)
    if s.max_num_batched_tokens is not None:
        cap = min(cap, s.max_num_batched_tokens)  # one token each per step
    return cap


def queue(
    w: Window, replicas: dict[str, Window], s: EngineSettings, spec: InferenceServiceSpec,
    model: ModelState, plan: Plan | None, limits: TuneLimits, now: float,
) -> Candidate | None:  # fmt: skip
    running, waiting = w.per_replica(w.running), w.per_replica(w.waiting)
    # Two turns in a row; or one, when the queue is already as deep as half the batch: then
    # the window in hand is enough, even the first scrape's (no turn before it, no span),
    # since each turn waited for adds a loop interval of arrivals to the backlog.
    persistent = len(model.queue) >= 2 and min(model.queue[-2:]) >= limits.min_waiting
    deep = waiting >= 0.5 * s.max_num_seqs
    if not (persistent or deep) or waiting < limits.min_waiting:
        return None
    if running < limits.slot_busy_fraction * s.max_num_seqs or worst_thrash(replicas) > 0:
        return None
    # Past the plan only where the queue is a backlog: where clients give up before their
    # TTFT target, the queue stays young, and a batch past the latency cap would cost its
    # own requests' TPOT and gain nothing.
    slower = model.slower(now)  # on a degraded plant the plan is the old machine's
    overload = slower == 1 and overloaded(s, model, plan) and backlog(w, spec, limits)
    new = safe_cap(w, s, spec, plan, limits, overload, slower)
    if new <= s.max_num_seqs:
        return None
    source = (
        f"PlantDegraded: steps {slower:.1f}x the model's" if slower > 1
        else "room for the queue (model not ready)" if plan is None
        else f"past the plan's {plan.max_num_seqs}: overloaded there" if overload
        else "the model's plan"
    )  # fmt: skip
    why = (
        f"queue: {waiting:.1f} waiting per replica with {running:.1f} of "
        f"{s.max_num_seqs} slots busy: max_num_seqs {s.max_num_seqs} -> {new} ({source})"
    )
    past = plan.max_num_seqs if overload and plan is not None and new > plan.max_num_seqs else None
    return Candidate("raise", replace(s, max_num_seqs=new), why, past_plan=past)


def remembered(c: Candidate, before: EngineSettings, spec: InferenceServiceSpec, now: float,
               last: OverloadRaise | None) -> OverloadRaise | None:  # fmt: skip
    """The overload memory an applied move leaves: an overload raise past the plan (from
    where the first of a run of them started), or ``last`` unchanged."""
    if c.past_plan is None:
        return last
    start = last.before if last is not None else before.max_num_seqs
    targets = (spec.ttft_target_seconds, spec.itl_target_seconds)
    return OverloadRaise(now, start, c.settings.max_num_seqs, c.past_plan, targets)


def overload_after(
    o: OverloadRaise, w: Window, s: EngineSettings, spec: InferenceServiceSpec,
    model: ModelState, plan: Plan, now: float, limits: TuneLimits,
) -> OverloadRaise | None:  # fmt: skip
    """The overload raise's memory after this turn; None once it no longer binds: the
    settings are back at or under the plan (nothing past it to keep), the SLO it was judged
    against changed (a new plan), or the overload has been gone (the arrival rate within
    the plan's capacity, the queue not growing, nobody waiting) for
    ``overload_clear_seconds``."""
    if s.max_num_seqs <= plan.max_num_seqs:
        return None
    if o.targets != (spec.ttft_target_seconds, spec.itl_target_seconds):
        return None
    queued = max(w.per_replica(w.waiting), model.queue[-1] if model.queue else 0.0)
    if overloaded(s, model, plan) or queued >= limits.min_waiting:
        return replace(o, clear_since=None)
    since = now if o.clear_since is None else o.clear_since
    if now - since >= limits.overload_clear_seconds:
        return None
    return replace(o, clear_since=since)


def overload_hold(o: OverloadRaise, model: ModelState, plan: Plan, now: float,
                  limits: TuneLimits) -> str:  # fmt: skip
    """Why the latency guardrail does not lower while ``o`` binds."""
    rate = model.per_replica().rate
    if o.clear_since is None:
        state = (
            f"the overload persists ({rate:.3g} requests/s per replica against the plan's "
            f"capacity of {plan.capacity:.3g}, or a queue)"
        )
    else:
        left = limits.overload_clear_seconds - (now - o.clear_since)
        state = f"the overload is gone since {now - o.clear_since:.0f} s, {left:.0f} s to go"
    return (
        f"latency lower held: max_num_seqs {o.before} -> {o.after} was an overload raise past "
        f"the plan's {o.plan}, and {state}: a lower would trade TPOT misses for TTFT misses "
        f"and the queue guardrail would raise again"
    )


def latency(
    w: Window, s: EngineSettings, spec: InferenceServiceSpec, model: ModelState,
    fit: Fit | None, plan: Plan | None, now: float, limits: TuneLimits,
) -> Candidate | None:  # fmt: skip
    finished = w.tpot_buckets[-1][1] if w.tpot_buckets else 0.0
    target = spec.itl_target_seconds
    if finished < limits.min_latency_requests or fit is None or plan is None:
        return None
    share = share_within(w.tpot_buckets, target)
    if share >= limits.latency_attainment or not fit.identified:
        return None
    if model.degraded(now) or model.queue_growing():
        return None
    if backlog(w, spec, limits) or draining(w, model, limits):
        return None  # a backlog drains slower after a lower: its TTFTs pay for the TPOTs
    demand = model.per_replica()
    running = w.per_replica(w.running)
    predicted = tpot_mean(fit, running, demand)
    if predicted <= target:
        return None  # the model does not put the miss on the batch: the machine, the prompts
    # The lowers lead to the latency cap: fewer slots must be faster there by the model, or
    # they cost throughput for no TPOT.
    gain = relief(fit, demand, running, max(spec.tuning.max_num_seqs.min, plan.latency_cap))
    if gain < MIN_RELIEF:
        return None
    new = max(_floor(s.max_num_seqs, spec, limits), min(s.max_num_seqs - 1, plan.latency_cap))
    if new >= s.max_num_seqs:
        return None
    why = (
        f"latency: {share:.0%} of {finished:.0f} requests met the {target * 1000:.0f} ms TPOT "
        f"target, and the model puts a step at batch {running:.1f} at "
        f"{predicted * 1000:.0f} ms ({gain:.0%} less at the latency cap): "
        f"max_num_seqs {s.max_num_seqs} -> {new}"
    )
    return Candidate("lower", replace(s, max_num_seqs=new), why)


def lora_bound(
    w: Window, s: EngineSettings, spec: InferenceServiceSpec, limits: TuneLimits
) -> str | None:
    """Why max_loras is the bottleneck (MaxLorasBottleneck), or None."""
    if spec.tuning.max_loras is None or w.lora_bottleneck < limits.lora_bottleneck_share:
        return None
    return (
        f"MaxLorasBottleneck: in {w.lora_bottleneck:.0%} of the window requests waited for "
        f"adapters with all {s.max_loras} LoRA slots taken and batch slots free"
    )


def loras(
    w: Window, s: EngineSettings, spec: InferenceServiceSpec, limits: TuneLimits
) -> Candidate | None:
    why, bounds = lora_bound(w, s, spec, limits), spec.tuning.max_loras
    if why is None or bounds is None or s.max_loras is None:
        return None
    new = min(bounds.max, math.ceil(s.max_loras * limits.lora_raise_factor))
    if new <= s.max_loras:
        return None  # at the bound: the tuner holds and says so; the autoscaler scales out
    return Candidate(
        "raise_loras", replace(s, max_loras=new), f"{why}: max_loras {s.max_loras} -> {new}"
    )


def fp8_off(w: Window, replicas: dict[str, Window], s: EngineSettings, spec: InferenceServiceSpec,
            limits: TuneLimits) -> Candidate | None:  # fmt: skip
    """Back to the spec's dtype when the KV cache would fit in 16 bits (a planned move)."""
    default = spec.engine.kv_cache_dtype
    if not is_fp8(s.kv_cache_dtype) or is_fp8(default) or worst_thrash(replicas) > 0:
        return None
    if (
        w.kv_cache_usage_peak >= limits.fp8_off_kv_peak
        or w.per_replica(w.waiting) >= limits.min_waiting
    ):
        return None
    why = f"KV cache peak {w.kv_cache_usage_peak:.0%} in fp8 would fit in 16 bits: {s.kv_cache_dtype} -> {default}"
    return Candidate("fp8_off", replace(s, kv_cache_dtype=default), why)
