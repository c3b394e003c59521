"""What the tuner may try next: the seed document's manual rules (§4.1, §5.1, §6) on one
window, as candidate changes in priority order (the law that picks one and judges it:
tune.py), and the thresholds both use (``TuneLimits``). Pure: no I/O, no clock.

``Signals`` reduces the window to what the rules compare, on the worst replica (an average
would hide one thrashing or slow replica of four); ``Rules`` turns them into
``Candidate``s; ``inputs_of`` is what a decision saw, for status and Events.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.loop.judge import Targets
from batchpilot.operator.loop.observe import Window, histogram_quantile
from batchpilot.operator.loop.tuner_state import EngineSettings, Kind, is_fp8

FP8 = "fp8"


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
