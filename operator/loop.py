"""One turn of the closed loop for one InferenceService: scrape, window, decide, apply live.

``ClosedLoop.run_once`` is what the operator's kopf timer calls. Everything it needs to
remember between turns, apart from the metric samples, is read back from the status it is
given and written into the status patch it returns, so the operator stays stateless across
restarts (losing the samples costs one window of observation, never a decision).

Contract with the kopf side (handlers.py):
- it passes the parsed spec, the current ``status`` dict, the Deployment's replica count,
  the engine settings in force (spec.engine with status.tuning applied: see
  ``resources.effective_engine``) and the service's admin token;
- it merges ``status_patch`` into status (keys ``metrics``, ``autoscaling``, ``tuning``);
  ``resources.LoopState.from_status`` reads ``autoscaling.desiredReplicas`` and
  ``tuning.maxNumSeqs`` / ``tuning.kvCacheDtype`` from it into the Deployment, so new pods
  start with the tuned values and an fp8 switch rolls the Deployment;
- it posts ``events`` as (reason, message) Events on the InferenceService.
This loop applies a raise or lower of max_num_seqs to every replica itself, live, through
/admin/config, and repairs any replica found running another value.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from batchpilot import names
from batchpilot.operator.admin_client import AdminClient
from batchpilot.operator.autoscale import (
    Recommendation,
    ScaleDecision,
    ScaleHistory,
    decide_replicas,
)
from batchpilot.operator.crd import InferenceServiceSpec
from batchpilot.operator.observe import MetricsSource, Observer, Window
from batchpilot.operator.tune import (
    HISTORY_LENGTH,
    EngineSettings,
    TuneDecision,
    TuneLimits,
    TuneRecord,
    decide_tuning,
    last_change,
    record,
)

EVENT_FOR_KIND = {
    "raise": "MaxNumSeqsRaised",
    "lower": "MaxNumSeqsLowered",
    "fp8": "KVCacheFP8",
}


def timestamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_timestamp(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


@dataclass
class LoopOutcome:
    status_patch: dict
    desired_replicas: int | None  # None: autoscaling disabled, spec.replicas rules
    tuning: TuneDecision | None  # None: tuning disabled
    events: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)
    scraped: int = 0  # replicas that answered this turn
    scrape_failures: dict[str, str] = field(default_factory=dict)  # URL -> why
    apply_failures: dict[str, str] = field(default_factory=dict)  # URL -> why


# --------------------------------------------------------------------------- status I/O


def tune_history(status: dict) -> list[TuneRecord]:
    out = []
    for d in (status.get("tuning") or {}).get("history") or []:
        try:
            out.append(
                TuneRecord(
                    time=parse_timestamp(d["time"]),
                    kind=d["kind"],
                    max_num_seqs=int(d[names.MAX_NUM_SEQS.crd_field]),
                    previous_max_num_seqs=int(d["previousMaxNumSeqs"]),
                    kv_cache_dtype=d[names.KV_CACHE_DTYPE.crd_field],
                    reason=d.get("reason", ""),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue  # an entry someone edited by hand: ignore it, never crash the loop
    return out


def tune_record_status(r: TuneRecord) -> dict:
    return {
        "time": timestamp(r.time),
        "kind": r.kind,
        names.MAX_NUM_SEQS.crd_field: r.max_num_seqs,
        "previousMaxNumSeqs": r.previous_max_num_seqs,
        names.KV_CACHE_DTYPE.crd_field: r.kv_cache_dtype,
        "reason": r.reason,
    }


def scale_history(status: dict) -> ScaleHistory:
    autoscaling = status.get("autoscaling") or {}
    recommendations = []
    for d in autoscaling.get("recommendations") or []:
        try:
            recommendations.append(Recommendation(int(d["replicas"]), parse_timestamp(d["time"])))
        except (KeyError, TypeError, ValueError):
            continue
    capacity = autoscaling.get("capacityTokensPerSecond")
    last_up = autoscaling.get("lastScaleUpTime")
    return ScaleHistory(
        tuple(recommendations),
        float(capacity) if isinstance(capacity, int | float) else None,
        _maybe_time(last_up),
    )


def _maybe_time(value: object) -> float | None:
    try:
        return parse_timestamp(value) if isinstance(value, str) else None
    except ValueError:
        return None


def autoscaling_status(d: ScaleDecision, now: float) -> dict:
    out = {
        "desiredReplicas": d.replicas,
        "recommendation": d.recommendation,
        "reason": d.reason,
        "time": timestamp(now),
        "recommendations": [
            {"replicas": r.replicas, "time": timestamp(r.time)} for r in d.history.recommendations
        ],
    }
    if d.history.capacity is not None:
        out["capacityTokensPerSecond"] = round(d.history.capacity, 1)
    if d.history.last_scale_up is not None:
        out["lastScaleUpTime"] = timestamp(d.history.last_scale_up)
    return out


def tuning_status(d: TuneDecision, history: list[TuneRecord], now: float) -> dict:
    return {
        names.MAX_NUM_SEQS.crd_field: d.max_num_seqs,
        names.KV_CACHE_DTYPE.crd_field: d.kv_cache_dtype,
        "lastDecision": d.kind,
        "reason": d.reason,
        "inputs": d.inputs,
        "time": timestamp(now),
        "history": [tune_record_status(r) for r in history[-HISTORY_LENGTH:]],
    }


# --------------------------------------------------------------------------- the loop


class ClosedLoop:
    def __init__(
        self,
        source: MetricsSource,
        admin: AdminClient,
        clock: Callable[[], float] = time.time,
        observer: Observer | None = None,
        limits: TuneLimits = TuneLimits(),
    ):
        self.source = source
        self.admin = admin
        self.clock = clock
        self.observer = observer or Observer()
        self.limits = limits

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted service's samples (the kopf side calls it on deletion)."""
        self.observer.forget(f"{namespace}/{name}")

    async def run_once(
        self,
        namespace: str,
        name: str,
        spec: InferenceServiceSpec,
        status: dict,
        replicas: int,
        settings: EngineSettings,
        admin_token: str,
    ) -> LoopOutcome:
        key = f"{namespace}/{name}"
        scrapes = await self.source.scrape(namespace, name)
        now = self.clock()
        scrape_round = self.observer.record(key, scrapes, now)
        window = self.observer.window(key)
        outcome = LoopOutcome(
            status_patch={},
            desired_replicas=None,
            tuning=None,
            scraped=scrape_round.scraped,
            scrape_failures=scrape_round.failures,
        )
        if window is not None:
            outcome.status_patch["metrics"] = {
                **window.summary(),
                "scrapeFailures": len(scrape_round.failures),
                "time": timestamp(now),
            }
        if spec.autoscaling.enabled:
            self._autoscale(outcome, window, spec, status, replicas, now)
        if spec.tuning.enabled:
            answered = [s.url for s in scrapes if s.url not in scrape_round.failures]
            await self._tune(outcome, key, spec, status, settings, admin_token, answered, now)
        return outcome

    def _autoscale(
        self,
        outcome: LoopOutcome,
        window: Window | None,
        spec: InferenceServiceSpec,
        status: dict,
        replicas: int,
        now: float,
    ) -> None:
        decision = decide_replicas(window, spec.autoscaling, replicas, now, scale_history(status))
        outcome.desired_replicas = decision.replicas
        outcome.status_patch["autoscaling"] = autoscaling_status(decision, now)
        if decision.replicas != replicas:
            reason = "ScaledUp" if decision.replicas > replicas else "ScaledDown"
            outcome.events.append(
                (reason, f"replicas {replicas} -> {decision.replicas}: {decision.reason}")
            )

    async def _tune(
        self,
        outcome: LoopOutcome,
        key: str,
        spec: InferenceServiceSpec,
        status: dict,
        settings: EngineSettings,
        token: str,
        urls: list[str],
        now: float,
    ) -> None:
        history = tune_history(status)
        previous = last_change(history)
        # Judge the settings in force on what ran under them only.
        window = self.observer.window(
            key, since=previous.time if previous else None, kv_cache_dtype=settings.kv_cache_dtype
        )
        decision = decide_tuning(window, spec.tuning, settings, now, history, self.limits)
        outcome.tuning = decision
        if decision.changes:
            history.append(record(decision, settings.max_num_seqs, now))
            outcome.events.append((EVENT_FOR_KIND[decision.kind], decision.reason))
        outcome.status_patch["tuning"] = tuning_status(decision, history, now)
        await self._apply(outcome, key, decision, token, urls)

    async def _apply(
        self, outcome: LoopOutcome, key: str, decision: TuneDecision, token: str, urls: list[str]
    ) -> None:
        """Put max_num_seqs in force on every replica that answered and runs another value:
        all of them after a raise or lower, a stray one (a pod started before the last
        change reached the template) otherwise."""
        if decision.kind == "fp8":
            return  # the Deployment rolls; new pods start with both settings
        reported = self.observer.window(key)
        in_force = reported.max_num_seqs if reported else {}
        stale = [u for u in urls if in_force.get(u) != decision.max_num_seqs]
        if not stale:
            return
        failures = await self.admin.set_max_num_seqs(stale, token, decision.max_num_seqs)
        outcome.apply_failures = {u: why for u, why in failures.items() if why}
        if outcome.apply_failures:
            outcome.events.append(
                (
                    "AdminApplyFailed",
                    f"max_num_seqs={decision.max_num_seqs} not applied on "
                    f"{len(outcome.apply_failures)} of {len(stale)} replicas: "
                    + "; ".join(f"{u}: {why}" for u, why in outcome.apply_failures.items()),
                )
            )
