"""The closed loop's memory in an InferenceService's status, typed: the one reader and
writer of ``status.autoscaling`` and ``status.tuning``. The operator is stateless across
restarts: whatever the loop must remember between turns, apart from metric samples, is
read back from there.

- ``AutoscalingStatus``, ``status.autoscaling``: the autoscaler's latest decision and its
  law's memory (``autoscale.ScaleHistory``), the idle law's memory (``idle.IdleState``; the
  CRD has no status.idle, its fields sit beside the autoscaler's) and a scale-down held
  while replicas do not answer their scrape.
- ``TunerState``, ``status.tuning``: the tuner's settings in force, the experiment on
  trial, its verdicts and history (their shapes: tuner_state.py), written with the latest
  decision and the replicas that did not take the live settings.
- ``LoopStatus``: both, as a turn reads them back; ``LoopState``: what the builders take
  from them (the replicas and engine settings the loops decided).

Reading forgives: a hand-edited entry is dropped, never a crash. Writes are merge patches:
a None removes a key (an experiment that is over, a hold that ended).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from batchpilot.operator.loop.autoscale import (
    Recommendation,
    ScaleDecision,
    ScaleDownHold,
    ScaleHistory,
)
from batchpilot.operator.loop.idle import IdleState
from batchpilot.operator.loop.model_state import ModelState
from batchpilot.operator.loop.timestamps import maybe_timestamp, parse_timestamp, timestamp
from batchpilot.operator.loop.tuner_state import (
    EngineSettings,
    Experiment,
    Move,
    OverloadRaise,
    TuneDecision,
    Verdict,
)

HISTORY_LENGTH = 20  # decisions kept in status.tuning.history
VERDICTS_KEPT = 32  # verdicts remembered (the oldest ones are forgotten first)

T = TypeVar("T")


def _field(status: dict | None, key: str) -> dict:
    value = (status or {}).get(key)
    return value if isinstance(value, dict) else {}


def _parsed(items: object, parse: Callable[[dict], T]) -> list[T]:
    """The entries ``parse`` can read; an entry someone edited by hand is ignored."""
    out = []
    for d in items if isinstance(items, list) else []:
        try:
            out.append(parse(d))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return out


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _count(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) else None


# --------------------------------------------------------------------------- autoscaling


@dataclass(frozen=True)
class AutoscalingStatus:
    """status.autoscaling: written each turn the autoscaler decides (never while blind)."""

    desired_replicas: int | None = None  # None: nothing decided yet (spec.replicas rules)
    recommendation: int | None = None  # the raw law's value, before stabilization
    reason: str = ""
    time: float | None = None
    history: ScaleHistory = field(default_factory=ScaleHistory)
    idle: IdleState = field(default_factory=IdleState)
    held: ScaleDownHold | None = None

    @classmethod
    def decided(
        cls, d: ScaleDecision, idle: IdleState, held: ScaleDownHold | None, now: float
    ) -> AutoscalingStatus:
        return cls(d.replicas, d.recommendation, d.reason, now, d.history, idle, held)

    @classmethod
    def from_status(cls, status: dict | None) -> AutoscalingStatus:
        d = _field(status, "autoscaling")
        held = _parsed([d.get("scaleDownHeld")], _hold_from_status)
        return cls(
            desired_replicas=_count(d.get("desiredReplicas")),
            recommendation=_count(d.get("recommendation")),
            reason=str(d.get("reason", "")),
            time=maybe_timestamp(d.get("time")),
            history=_history_from_status(d),
            idle=IdleState(
                maybe_timestamp(d.get("lastActiveTime")),
                maybe_timestamp(d.get("scaledToZeroTime")),
                _number(d.get("generationTokensSeen")),
            ),
            held=held[0] if held else None,
        )

    def to_status(self) -> dict:
        h, idle = self.history, self.idle
        out = {
            "desiredReplicas": self.desired_replicas,
            "recommendation": self.recommendation,
            "reason": self.reason,
            "time": timestamp(self.time) if self.time is not None else None,
            "recommendations": [
                {"replicas": r.replicas, "time": timestamp(r.time)} for r in h.recommendations
            ],
            # Per engine settings (EngineSettings.key): what one replica sustained under them.
            "capacityTokensPerSecond": {k: round(v, 1) for k, v in h.capacities},
        }
        if h.last_scale_up is not None:
            out["lastScaleUpTime"] = timestamp(h.last_scale_up)
        return out | {
            # None removes scaledToZeroTime once the service is back.
            "lastActiveTime": timestamp(idle.last_active) if idle.last_active else None,
            "scaledToZeroTime": timestamp(idle.zero_since) if idle.zero_since else None,
            "generationTokensSeen": idle.tokens_seen,
            # None removes a hold that is over.
            "scaleDownHeld": _hold_to_status(self.held) if self.held else None,
        }


def _history_from_status(d: dict) -> ScaleHistory:
    capacities = d.get("capacityTokensPerSecond")
    return ScaleHistory(
        tuple(
            _parsed(
                d.get("recommendations"),
                lambda r: Recommendation(int(r["replicas"]), parse_timestamp(r["time"])),
            )
        ),
        tuple(
            (k, float(v))
            for k, v in (capacities.items() if isinstance(capacities, dict) else ())
            if isinstance(v, int | float)
        ),
        maybe_timestamp(d.get("lastScaleUpTime")),
    )


def _hold_to_status(held: ScaleDownHold) -> dict:
    return {
        "replicas": held.replicas,
        "recommendation": held.recommendation,
        "unscraped": list(held.unscraped),
    }


def _hold_from_status(d: dict) -> ScaleDownHold:
    return ScaleDownHold(
        int(d["replicas"]), int(d["recommendation"]), tuple(str(u) for u in d["unscraped"])
    )


# --------------------------------------------------------------------------- tuning


@dataclass(frozen=True)
class TunerState:
    """status.tuning: what the tuner remembers between turns."""

    settings: EngineSettings | None = None  # None: nothing decided yet (spec.engine rules)
    experiment: Experiment | None = None
    verdicts: tuple[Verdict, ...] = ()
    history: tuple[TuneDecision, ...] = ()
    model: ModelState = field(default_factory=ModelState)
    planned_epoch: int | None = None  # the model epoch the last plan was made under
    planned_at: float | None = None
    planned_requests: float = 0.0  # the demand's evidence then (a plan is redone once it doubles)
    # The last raise past the plan on an overload, while it binds (the latency guardrail
    # does not undo it while the overload lasts); None: none, or it no longer binds.
    overload: OverloadRaise | None = None

    @property
    def last_change(self) -> float | None:
        return max((d.time for d in self.history), default=None)

    def blocked(self, move: Move, epoch: int) -> Verdict | None:
        """The verdict that forbids ``move`` under the model's ``epoch``, if any."""
        return next((v for v in self.verdicts if v.settings == move.key and v.blocks(epoch)), None)

    def judged(self, move: Move, kept: bool, now: float, epoch: int) -> TunerState:
        verdict = Verdict(move.key, kept, now, epoch)
        others = tuple(v for v in self.verdicts if v.settings != move.key)
        return replace(self, verdicts=(*others, verdict)[-VERDICTS_KEPT:])

    def decided(self, d: TuneDecision, experiment: Experiment | None) -> TunerState:
        # The history keeps what was decided and measured; the inputs are the latest's only.
        history = (*self.history, replace(d, inputs={})) if d.changes else self.history
        return replace(
            self, settings=d.settings, experiment=experiment, history=history[-HISTORY_LENGTH:]
        )

    @classmethod
    def from_status(cls, status: dict | None) -> TunerState:
        tuning = _field(status, "tuning")
        try:
            settings = EngineSettings.from_status(tuning)
        except (KeyError, TypeError, ValueError):
            settings = None
        experiments = _parsed([tuning.get("experiment")], Experiment.from_status)
        models = _parsed([tuning.get("model")], ModelState.from_status)
        plan = _field(tuning, "plan")
        overload = _parsed([tuning.get("overloadRaise")], OverloadRaise.from_status)
        return cls(
            settings=settings,
            experiment=experiments[0] if experiments else None,
            verdicts=tuple(_parsed(tuning.get("verdicts"), Verdict.from_status)),
            history=tuple(_parsed(tuning.get("history"), TuneDecision.from_status)),
            model=models[0] if models else ModelState(),
            planned_epoch=_count(plan.get("epoch")),
            planned_at=_number(plan.get("time")),
            planned_requests=_number(plan.get("requests")) or 0.0,
            overload=overload[0] if overload else None,
        )

    def to_status(
        self, latest: TuneDecision, now: float, not_applied: dict[str, str] | None = None
    ) -> dict:
        """status.tuning after ``latest``; ``not_applied``: replica URL -> why it did not
        take the live settings (None: nothing was applied this turn, the last word stays)."""
        assert self.settings is not None
        out = {
            **self.settings.to_status(),
            "lastDecision": latest.action,
            "reason": latest.reason,
            "inputs": latest.inputs,
            "time": timestamp(now),
            "experiment": self.experiment.to_status() if self.experiment else None,
            "verdicts": [v.to_status() for v in self.verdicts],
            "history": [d.to_status() for d in self.history],
            "model": self.model.to_status(),
            "plan": {
                "epoch": self.planned_epoch,
                "time": self.planned_at,
                "requests": round(self.planned_requests, 1),
            },
            # None removes a memory that no longer binds.
            "overloadRaise": self.overload.to_status() if self.overload else None,
        }
        if not_applied is not None:
            out["notApplied"] = [
                {"replica": u, "reason": why} for u, why in sorted(not_applied.items())
            ]
        return out


def settings_from_status(status: dict | None) -> EngineSettings | None:
    """The settings the tuner keeps in force on every replica, None before its first
    decision (what new pods start with)."""
    return TunerState.from_status(status).settings


# --------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class LoopStatus:
    """What a turn reads back from status."""

    autoscaling: AutoscalingStatus = AutoscalingStatus()
    tuner: TunerState = TunerState()
    tuning_reason: str = ""  # the latest tuning decision's (an Event says when it changes)

    @classmethod
    def from_status(cls, status: dict | None) -> LoopStatus:
        return cls(
            AutoscalingStatus.from_status(status),
            TunerState.from_status(status),
            str(_field(status, "tuning").get("reason", "")),
        )


@dataclass(frozen=True)
class LoopState:
    """What the autoscaler and the tuner have decided, read back from status (None: nothing
    yet). The builders persist it in the Deployment so that new pods start with it."""

    replicas: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str | None = None
    max_num_batched_tokens: int | None = None
    max_loras: int | None = None

    @classmethod
    def from_status(cls, status: dict | None) -> LoopState:
        tuned = settings_from_status(status)
        return cls(
            replicas=AutoscalingStatus.from_status(status).desired_replicas,
            max_num_seqs=tuned.max_num_seqs if tuned else None,
            kv_cache_dtype=tuned.kv_cache_dtype if tuned else None,
            max_num_batched_tokens=tuned.max_num_batched_tokens if tuned else None,
            max_loras=tuned.max_loras if tuned else None,
        )
