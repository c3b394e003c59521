"""One turn of the closed loop for one InferenceService: scrape, window, decide, apply live.

``ClosedLoop.run_once`` is what the operator's kopf timer calls. Everything it needs to
remember between turns, apart from the metric samples, is read back from the status it is
given and written into the status patch it returns, so the operator stays stateless across
restarts (losing the samples costs one window of observation, never a decision).

One arbiter decides tuning and scaling together, in that order:
- the tuner first (tune.py, the loop v3): it learns the replica's model, applies guardrail
  moves at once and tests one planned change at a time;
- then the autoscaler (autoscale.py), which sizes replicas with the tuner's model (its
  capacity per replica within the SLO) and the queue law as the fast guard, and whose
  decision the tuner's state can hold: no scale-up (short of an emergency queue) while a
  planned raise is under test, since it may remove the queue the scale-up answers; no
  scale-down while any change is under test or for ``ENGINE_CHANGE_FREEZE_SECONDS`` after
  one, since the window it reads was measured under other settings.
- With ``autoscaling.minReplicas: 0``, the idle law (idle.py) takes an idle service to zero
  (never while a trial or the post-change freeze holds scale-downs) and wakes it when the
  activator asks; at zero it alone decides, since the queue law has no replica to read.
- Nothing is decided while the loop is blind: fewer than ``MIN_SCRAPED_SHARE`` of the
  Ready replicas answered their scrape. ``status.metrics.loopBlind`` says why (the
  reconcile turns it into the LoopBlind condition) and a LoopBlind Event is posted.

Contract with the kopf side (timer.py): it passes the parsed spec, the current
``status``, the Deployment's replica count, the engine settings in force, the admin token
and the latest wake request (idle.WAKE_ANNOTATION); it merges ``status_patch`` into status
(keys ``metrics``, ``autoscaling``, ``tuning``: state.py reads and writes the last two) and
posts ``events``. This loop puts live settings (max_num_seqs, max_num_batched_tokens) in
force on every replica itself, through /admin/config: the canary's on the canary, the kept
ones on the others, and repairs any replica found running other values. A KV dtype change
reaches pods through the Deployment (a rollout).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from batchpilot.operator.bounds import clip
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.loop.admin_client import AdminClient
from batchpilot.operator.loop.autoscale import (
    Recommendation,
    ScaleDecision,
    ScaleDownHold,
    decide_replicas,
)
from batchpilot.operator.loop.guardrails import TuneLimits
from batchpilot.operator.loop.idle import decide_idle
from batchpilot.operator.loop.observe import Observer, RoundResult, Window
from batchpilot.operator.loop.planner import Bounds, capacity_batch, capacity_in, replicas_for
from batchpilot.operator.loop.scrape import MetricsSource
from batchpilot.operator.loop.state import AutoscalingStatus, LoopStatus, TunerState
from batchpilot.operator.loop.timestamps import timestamp
from batchpilot.operator.loop.tune import View, decide_tuning
from batchpilot.operator.loop.tuner_state import EngineSettings, TuneDecision

MIN_SCRAPED_SHARE = 0.5  # below this share of Ready replicas answering, the loop is blind
ENGINE_CHANGE_FREEZE_SECONDS = 300.0  # no scale-down this long after an engine change
EMERGENCY_QUEUE_FACTOR = 4.0  # a queue this many times the target scales up regardless
CAPACITY_KINDS = ("raise", "raise_budget", "fp8", "raise_loras")  # may remove a queue
BOTTLENECK = "MaxLorasBottleneck"  # the LoRA guardrail's reasons start with it

EVENT_FOR_ACTION = {
    "guard": "TuningGuardrail",
    "try": "TuningTrial",
    "canary": "TuningTrial",
    "keep": "TuningKept",
    "rollout": "TuningKept",
    "revert": "TuningReverted",
    "abandon": "TuningAbandoned",
}


@dataclass
class LoopOutcome:
    status_patch: dict
    desired_replicas: int | None  # None: autoscaling disabled, spec.replicas rules
    tuning: TuneDecision | None  # None: tuning disabled
    events: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)
    scraped: int = 0  # replicas that answered this turn
    scrape_failures: dict[str, str] = field(default_factory=dict)  # URL -> why
    apply_failures: dict[str, str] = field(default_factory=dict)  # URL -> why
    blind: str | None = None  # why the loop decided nothing, when it could not see
    capacity: float | None = None  # requests/s a replica completes within the SLO (the model's)
    capacity_seen: bool = False  # at a batch the model has seen, not by extrapolation
    arrivals: float = 0.0  # the model's sustained arrivals per second to the service

    def event(self, reason: str, message: str) -> None:
        """An Event to post; its message may carry what replicas answered, so it is clipped."""
        self.events.append((reason, clip(message)))


# --------------------------------------------------------------------------- the arbiter


def hold_scale_down(
    decision: ScaleDecision, replicas: int, failures: dict[str, str], now: float
) -> tuple[ScaleDecision, ScaleDownHold]:
    """Keep ``replicas`` while a Ready replica's scrape fails and the replicas that answered
    ask for fewer.

    A replica that does not answer its scrape is not a replica without demand: its samples
    age out of the window and the others' alone would then look like the whole load (half
    of it, with two replicas), and the scale-down would remove capacity that is serving.
    HPA likewise assumes missing metrics at the target when scaling down. Scale-ups still go
    through: they rest on the replicas that answered, which is demand seen, not guessed.

    The low recommendations are not kept either (they were made on part of the demand): the
    history keeps ``replicas`` for now instead, so that once every replica answers again a
    scale-down needs a whole stabilization window of its own evidence."""
    urls = sorted(failures)
    reason = clip(
        f"scale-down held at {replicas}: {len(urls)} Ready replica(s) did not answer their "
        f"scrape ({'; '.join(f'{u}: {failures[u]}' for u in urls)}); the others alone "
        f"recommend {decision.recommendation}: {decision.reason}"
    )  # status.autoscaling.reason, with what the replicas answered
    held = ScaleDownHold(replicas, decision.recommendation, tuple(urls))
    kept = {r.replicas: r.time for r in decision.history.recommendations if r.replicas >= replicas}
    kept[replicas] = now
    history = replace(
        decision.history,
        recommendations=tuple(Recommendation(n, t) for n, t in sorted(kept.items())),
    )
    return replace(decision, replicas=replicas, reason=reason, history=history), held


def scale_event(before: int, after: int) -> str:
    if after == 0:
        return "ScaledToZero"
    if before == 0:
        return "WokenFromZero"
    return "ScaledUp" if after > before else "ScaledDown"


def blindness(listed: int, scrape_round: RoundResult) -> str | None:
    """Why the loop cannot see enough to decide, or None."""
    if listed == 0 or scrape_round.scraped >= MIN_SCRAPED_SHARE * listed:
        return None
    why = "; ".join(f"{u}: {e}" for u, e in sorted(scrape_round.failures.items()))
    return clip(
        f"{scrape_round.scraped} of {listed} Ready replicas answered their scrape (at least "
        f"{MIN_SCRAPED_SHARE:.0%} needed to decide): {why}"
    )  # status.metrics.loopBlind, and the LoopBlind condition's message


def arbitrate(
    decision: ScaleDecision,
    replicas: int,
    tuner: TunerState,
    window: Window | None,
    target_queue: float,
    now: float,
) -> ScaleDecision:
    """The autoscaler's decision, held where the tuner's state says it must wait."""
    e = tuner.experiment
    if decision.replicas > replicas and e is not None and e.kind in CAPACITY_KINDS:
        queue = window.per_replica(window.waiting_now) if window else 0.0
        if queue < EMERGENCY_QUEUE_FACTOR * target_queue:
            why = f"tuning first: {e.kind} is on trial and may remove the queue; {decision.reason}"
            return replace(decision, replicas=replicas, reason=why)
    last = tuner.last_change
    recent = last is not None and now - last < ENGINE_CHANGE_FREEZE_SECONDS
    if decision.replicas < replicas and (e is not None or recent):
        why = (
            f"scale-down frozen: an engine change is on trial or was made under "
            f"{ENGINE_CHANGE_FREEZE_SECONDS:.0f} s ago; {decision.reason}"
        )
        return replace(decision, replicas=replicas, reason=why)
    return decision


def tuning_event(decision: TuneDecision, last_reason: str) -> tuple[str, str] | None:
    """The Event of a tuning decision: each change; a LoRA bottleneck as its own reason
    (MaxLorasBottleneck), also when held at the bound, then once until it clears."""
    bottleneck = decision.reason.removeprefix("guardrail: ").startswith(BOTTLENECK)
    if decision.changes:
        tried = bottleneck and decision.action == "guard"
        return (BOTTLENECK if tried else EVENT_FOR_ACTION[decision.action], decision.reason)
    if bottleneck and not last_reason.startswith(BOTTLENECK):
        return BOTTLENECK, decision.reason
    return None


def model_capacity(
    tuner: TunerState, spec: InferenceServiceSpec, settings: EngineSettings
) -> tuple[float | None, bool]:
    """Requests/s one replica completes within the SLO at ``settings``, from the tuner's
    model (None before it is ready): the capacity the autoscaler sizes replicas with; and
    whether the model has seen a batch that large (else the figure is its extrapolation)."""
    m = tuner.model
    fit = m.fit()
    if fit is None or not m.demand.ready:
        return None, False
    b, demand = spec.tuning.max_num_seqs, m.per_replica()
    batch = capacity_batch(fit, demand, spec.itl_target_seconds, settings.max_num_seqs,
                           Bounds(b.min, b.max))  # fmt: skip
    return capacity_in(fit, demand, batch), fit.model.max_batch >= batch


def sized_by_model(outcome: LoopOutcome, replicas: int) -> int | None:
    """The replicas the model's capacity sizes the service at, None without one. Past the
    batches the model has seen, its capacity is an extrapolation that errs low (GPU
    mismatch plant, steady load: a third replica for 5 minutes after a raise, where the
    queue law needed 0.8 of one): then it may hold replicas, not add them."""
    if not outcome.capacity:
        return None
    wanted = replicas_for(outcome.arrivals, outcome.capacity)
    return wanted if outcome.capacity_seen else min(wanted, replicas)


def live_targets(tuner: TunerState, urls: list[str]) -> dict[str, EngineSettings]:
    """The live settings each replica should run: the kept ones, the canary's its own."""
    assert tuner.settings is not None
    e = tuner.experiment
    return {u: e.after if e is not None and e.canary == u else tuner.settings for u in urls}


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
        wake_at: float | None = None,
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
            blind=blindness(len(scrapes), scrape_round),
        )
        self._observed(outcome, window, status, now)
        last = LoopStatus.from_status(status)
        tuner = last.tuner
        if spec.tuning.enabled:
            tuner = self._tune(outcome, key, spec, tuner, settings, now, last.tuning_reason)
        if spec.autoscaling.enabled:
            # A replica's capacity is measured under the settings that ran before this
            # turn's decision, over the samples since they were set: not credited to those
            # the tuner just chose, nor to a queue the old ones left behind.
            ran = last.tuner
            measured = (
                ran.settings.key if ran.settings else "",
                list(self.observer.replica_windows(key, since=ran.last_change).values()),
            )
            self._autoscale(
                outcome, window, spec, last.autoscaling, replicas, now, tuner, wake_at, measured
            )
        if spec.tuning.enabled:
            not_applied = None  # blind: nothing was applied, the last word on it stays
            if outcome.blind is None:
                answered = {
                    s.url: s.admin_url
                    for s in scrapes
                    if s.url not in scrape_round.failures and s.admin_url
                }
                await self._apply(outcome, key, tuner, admin_token, answered)
                not_applied = outcome.apply_failures
            assert outcome.tuning is not None
            outcome.status_patch["tuning"] = tuner.to_status(outcome.tuning, now, not_applied)
        return outcome

    def _observed(self, outcome: LoopOutcome, window: Window | None, status: dict, now: float):
        metrics = {**window.summary()} if window is not None else {}
        metrics |= {
            "scrapeFailures": len(outcome.scrape_failures),
            "time": timestamp(now),
            "loopBlind": outcome.blind,  # None clears it (merge patch)
        }
        outcome.status_patch["metrics"] = metrics
        was_blind = bool((status.get("metrics") or {}).get("loopBlind"))
        if outcome.blind and not was_blind:
            outcome.event("LoopBlind", f"deciding nothing: {outcome.blind}")
        elif was_blind and not outcome.blind:
            outcome.event("LoopSighted", "enough replicas answer again: deciding")

    def _tune(
        self,
        outcome: LoopOutcome,
        key: str,
        spec: InferenceServiceSpec,
        tuner: TunerState,
        in_force: EngineSettings,
        now: float,
        last_reason: str = "",
    ) -> TunerState:
        if outcome.blind is not None:
            settings = tuner.settings or in_force
            decision = TuneDecision("hold", settings, clip(f"blind: {outcome.blind}"), now)
            tuner = tuner.decided(decision, tuner.experiment)
        else:
            settings = tuner.settings or in_force
            e = tuner.experiment
            since = e.started if e is not None else tuner.last_change
            # Proposals read what ran under the settings in force; a verdict reads each
            # replica with the settings it reports.
            dtype = None if e is not None else settings.kv_cache_dtype
            view = View(
                service=self.observer.window(key, since=since, kv_cache_dtype=dtype),
                replicas=self.observer.replica_windows(key, since=since, kv_cache_dtype=dtype),
                latest=self.observer.window(key, since=tuner.model.observed_until),
                latest_replicas=self.observer.replica_windows(
                    key, since=tuner.model.observed_until
                ),
            )
            decision, tuner = decide_tuning(view, spec, tuner, in_force, now, self.limits)
        outcome.tuning = decision
        outcome.capacity, outcome.capacity_seen = model_capacity(
            tuner, spec, tuner.settings or in_force
        )
        outcome.arrivals = tuner.model.demand.sustained
        for change in tuner.model.changes:
            plant = change.startswith("plant changed")
            outcome.event("PlantDegraded" if plant else "WorkloadChanged", change)
        if event := tuning_event(decision, last_reason):
            outcome.event(*event)
        return tuner

    def _autoscale(
        self,
        outcome: LoopOutcome,
        window: Window | None,
        spec: InferenceServiceSpec,
        last: AutoscalingStatus,
        replicas: int,
        now: float,
        tuner: TunerState,
        wake_at: float | None,
        measured: tuple[str, list[Window]],
    ) -> None:
        if outcome.blind is not None:
            outcome.desired_replicas = replicas
            return  # status.autoscaling keeps the last decision; metrics.loopBlind says why
        a = spec.autoscaling
        # Every replica of the Deployment answered: none failed, none is still starting.
        all_scraped = not outcome.scrape_failures and outcome.scraped >= replicas
        idle = decide_idle(a, replicas, window, all_scraped, last.idle, wake_at, now)
        held = None
        if replicas == 0 and a.min_replicas == 0:
            # At zero the idle law alone decides: the queue law has no replica to read, and
            # samples left from the last one would read as demand.
            zero = 0 if idle.replicas is None else idle.replicas
            decision = ScaleDecision(zero, idle.reason, zero, last.history)
        else:
            by_model = None
            if window is not None:
                by_model = sized_by_model(outcome, replicas)
            decision = decide_replicas(
                window, a, replicas, now, last.history, tuner.settings, by_model, measured
            )
            if idle.replicas == 0:
                decision = replace(decision, replicas=0, reason=idle.reason)
            if decision.recommendation < replicas and outcome.scrape_failures:
                decision, held = hold_scale_down(decision, replicas, outcome.scrape_failures, now)
            if spec.tuning.enabled:
                decision = arbitrate(decision, replicas, tuner, window, a.target_queue_length, now)
        outcome.desired_replicas = decision.replicas
        state = idle.state
        if decision.replicas > 0 and state.zero_since is not None:
            state = replace(state, zero_since=None)  # the zero was held (a trial, a freeze)
        written = AutoscalingStatus.decided(decision, state, held, now)
        outcome.status_patch["autoscaling"] = written.to_status()
        if held is not None and last.held is None:
            outcome.event("ScaleDownHeld", decision.reason)
        if decision.replicas != replicas:
            outcome.event(
                scale_event(replicas, decision.replicas),
                f"replicas {replicas} -> {decision.replicas}: {decision.reason}",
            )

    async def _apply(
        self,
        outcome: LoopOutcome,
        key: str,
        tuner: TunerState,
        token: str,
        urls: dict[str, str],
    ) -> None:
        """Put the live settings in force on every replica that answered and reports other
        values; record where that failed (the status then says so: a change counts as
        applied only where a replica confirmed it)."""
        reported = self.observer.window(key)
        targets = live_targets(tuner, sorted(urls))
        changes_by_url = {}
        for url, target in targets.items():
            now_running = EngineSettings(
                max_num_seqs=(reported.max_num_seqs if reported else {}).get(url, -1),
                max_num_batched_tokens=(reported.max_num_batched_tokens if reported else {}).get(
                    url
                ),
            )
            changes = target.live_changes(now_running)
            if changes:
                changes_by_url[url] = changes
        # Replicas that need the same change get it in one concurrent call.
        groups: dict[tuple, list[str]] = {}
        for url, changes in changes_by_url.items():
            groups.setdefault(tuple(sorted(changes.items())), []).append(url)
        answers = await asyncio.gather(
            *(self.admin.set_live([urls[u] for u in g], token, dict(c)) for c, g in groups.items())
        )
        failures = {
            u: clip(why)  # status.tuning.notApplied: what a replica answered
            for g, answer in zip(groups.values(), answers, strict=True)
            for u in g
            if (why := answer.get(urls[u]))
        }
        outcome.apply_failures = failures
        if failures:
            outcome.event(
                "AdminApplyFailed",
                f"live settings not applied on {len(failures)} of {len(changes_by_url)} "
                "replicas: " + "; ".join(f"{u}: {why}" for u, why in failures.items()),
            )
