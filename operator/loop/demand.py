"""What a service is asked to do, estimated online: the service's arrival rate and the
prompt and output lengths (means and 95th percentiles), from the servers' arrival counter
and per-request token histograms, with a change-point detector on each (changes.py): a
workload that changed is re-planned. Decayed means with a five-minute half-life, kept in
status.tuning.model. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from batchpilot.operator.loop.changes import Cusum
from batchpilot.operator.loop.observe import Window, histogram_quantile

HALF_LIFE_SECONDS = 300.0
# The sustained rate the autoscaler sizes replicas by: slower, and never reset by a change
# point (the queue law answers bursts; sizing on them would flap).
SUSTAINED_HALF_LIFE_SECONDS = 900.0
MIN_REQUESTS = 5  # finished requests before a window says anything about lengths


@dataclass(frozen=True)
class Demand:
    # Arrivals per second to the whole service (not per replica: a scale event is not a
    # change of the workload); ModelState.per_replica divides.
    rate: float = 0.0
    sustained: float = 0.0  # the same, over SUSTAINED_HALF_LIFE_SECONDS
    prompt_mean: float = 0.0
    output_mean: float = 0.0
    prompt_p95: float = 0.0
    output_p95: float = 0.0
    seconds: float = 0.0  # observation behind the rate (decayed)
    requests: float = 0.0  # finished requests behind the lengths (decayed)
    # Per-bucket counts of the lengths (vLLM's 1-2-5 buckets, not cumulative), decayed: the
    # twin draws lengths from them (twin.py).
    prompt_hist: tuple[tuple[float, float], ...] = ()
    output_hist: tuple[tuple[float, float], ...] = ()
    rate_cusum: Cusum = field(default_factory=Cusum)
    prompt_cusum: Cusum = field(default_factory=Cusum)
    output_cusum: Cusum = field(default_factory=Cusum)

    @property
    def ready(self) -> bool:
        return self.seconds >= 30 and self.requests >= MIN_REQUESTS

    def ingest(self, w: Window) -> tuple[Demand, list[str]]:
        """The estimate after a window of new observations, and what changed in it."""
        span = w.span_seconds
        if span <= 0:
            return self, []
        changed: list[str] = []
        arrivals = w.arrivals_per_second * span
        g = 0.5 ** (span / SUSTAINED_HALF_LIFE_SECONDS)
        sustained = (
            arrivals / span if self.seconds == 0 else g * self.sustained + (1 - g) * arrivals / span
        )
        d = replace(self._rate(arrivals, span, changed), sustained=sustained)
        if w.requests_finished >= MIN_REQUESTS:
            d = d._lengths(w, changed)
        return d, changed

    def _rate(self, arrivals: float, span: float, changed: list[str]) -> Demand:
        expected = self.rate * span
        cusum = self.rate_cusum
        if self.seconds >= 60 and expected > 0:
            # Poisson counts: a standard deviation of sqrt(expected).
            cusum, side = cusum.update((arrivals - expected) / math.sqrt(max(expected, 1.0)))
            if side:
                changed.append(f"arrival rate went {side}")
                return replace(self, rate=arrivals / span, seconds=span, rate_cusum=cusum)
        f = 0.5 ** (span / HALF_LIFE_SECONDS)
        seconds = self.seconds * f + span
        rate = (self.rate * self.seconds * f + arrivals) / seconds
        return replace(self, rate=rate, seconds=seconds, rate_cusum=cusum)

    def _lengths(self, w: Window, changed: list[str]) -> Demand:
        n = w.requests_finished
        prompt, output = w.prompt_tokens_sum / n, w.output_tokens_sum / n
        p95 = histogram_quantile(0.95, w.prompt_tokens_buckets) or prompt
        o95 = histogram_quantile(0.95, w.output_tokens_buckets) or output
        cusums, fresh = {}, False
        for key, value, mean in (
            ("prompt", prompt, self.prompt_mean),
            ("output", output, self.output_mean),
        ):
            cusum = getattr(self, f"{key}_cusum")
            if self.requests >= 4 * MIN_REQUESTS and mean > 0:
                # Lengths spread about as wide as their mean: a standard error of mean/sqrt(n).
                cusum, side = cusum.update((value - mean) / (mean / math.sqrt(n)))
                if side:
                    changed.append(f"{key} length went {side}")
                    fresh = True
            cusums[f"{key}_cusum"] = cusum
        ph, oh = _per_bucket(w.prompt_tokens_buckets), _per_bucket(w.output_tokens_buckets)
        if fresh:
            return replace(self, prompt_mean=prompt, output_mean=output, prompt_p95=p95,
                           output_p95=o95, requests=n, prompt_hist=ph, output_hist=oh,
                           **cusums)  # fmt: skip
        f = 0.5 ** (w.span_seconds / HALF_LIFE_SECONDS)
        old = self.requests * f
        total = old + n

        def mix(a: float, b: float) -> float:
            return (a * old + b * n) / total

        return replace(
            self, prompt_mean=mix(self.prompt_mean, prompt), output_mean=mix(self.output_mean, output),
            prompt_p95=mix(self.prompt_p95, p95), output_p95=mix(self.output_p95, o95),
            requests=total, prompt_hist=_mixed(self.prompt_hist, ph, f),
            output_hist=_mixed(self.output_hist, oh, f), **cusums,
        )  # fmt: skip

    def to_status(self) -> dict:
        return {
            "arrivalsPerSecond": round(self.rate, 4),
            "sustainedArrivalsPerSecond": round(self.sustained, 4),
            "promptTokensMean": round(self.prompt_mean, 1),
            "outputTokensMean": round(self.output_mean, 1),
            "promptTokensP95": round(self.prompt_p95, 1),
            "outputTokensP95": round(self.output_p95, 1),
            "seconds": round(self.seconds, 1),
            "requests": round(self.requests, 1),
            "promptHistogram": _hist_status(self.prompt_hist),
            "outputHistogram": _hist_status(self.output_hist),
            "cusum": {
                "rate": self.rate_cusum.to_status(),
                "prompt": self.prompt_cusum.to_status(),
                "output": self.output_cusum.to_status(),
            },
        }

    @classmethod
    def from_status(cls, d: dict) -> Demand:
        c = d.get("cusum") or {}
        return cls(
            rate=float(d["arrivalsPerSecond"]),
            sustained=float(d.get("sustainedArrivalsPerSecond", 0.0)),
            prompt_mean=float(d["promptTokensMean"]),
            output_mean=float(d["outputTokensMean"]),
            prompt_p95=float(d["promptTokensP95"]),
            output_p95=float(d["outputTokensP95"]),
            seconds=float(d["seconds"]),
            requests=float(d["requests"]),
            prompt_hist=_hist(d.get("promptHistogram")),
            output_hist=_hist(d.get("outputHistogram")),
            rate_cusum=Cusum.from_status(c.get("rate", (0, 0))),
            prompt_cusum=Cusum.from_status(c.get("prompt", (0, 0))),
            output_cusum=Cusum.from_status(c.get("output", (0, 0))),
        )


def _per_bucket(cumulative) -> tuple[tuple[float, float], ...]:
    out, below = [], 0.0
    for le, count in cumulative:
        out.append((le, max(0.0, count - below)))
        below = count
    return tuple(out)


def _mixed(old, new, keep: float) -> tuple[tuple[float, float], ...]:
    total: dict[float, float] = {le: c * keep for le, c in old}
    for le, c in new:
        total[le] = total.get(le, 0.0) + c
    return tuple(sorted((le, c) for le, c in total.items() if c > 1e-6))


def _hist_status(hist) -> list[list]:
    """[[upper bound, count], ...]; the last bucket's bound written "+Inf", as Prometheus
    writes it (JSON has no infinity: a patch carrying one is refused whole)."""
    return [[le if math.isfinite(le) else "+Inf", round(c, 2)] for le, c in hist]


def _hist(value: object) -> tuple[tuple[float, float], ...]:
    if not isinstance(value, list):
        return ()
    return tuple((float(le), float(c)) for le, c in value)  # float("+Inf") is inf
