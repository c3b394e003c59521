"""The loop v3's memory of the replica and its workload, in status.tuning.model: the step
model's statistics (plant.py), the demand (demand.py), the residual's change detector, the
model's epoch (a change point or a refit starts a new one), a plant-degraded episode, the
times of planned changes (at most two an hour) and the recent queue (is it growing?).

``ingest`` is one turn of learning: the new window's step cells are first compared with the
model's prediction (the residual: did the machine change?), then added to it; the window's
arrivals and lengths update the demand (did the workload change?). Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from batchpilot.operator.loop.changes import Cusum
from batchpilot.operator.loop.demand import Demand
from batchpilot.operator.loop.observe import Window
from batchpilot.operator.loop.plant import MIN_CELL_STEPS, Fit, StepModel, cell_observation

# The residual's detector: the relative gap between measured and predicted step time, per
# turn. Tuned to see a sustained 25 % slowdown within about ten turns and a 4x neighbour at
# once; the model's own misfit is added to the slack, so a plant that is not the model's
# form does not alarm forever.
RESIDUAL_DRIFT = 0.1
RESIDUAL_THRESHOLD = 1.0
SETTLE_SECONDS = 600.0  # a degraded plant is frozen this long after its last alarm
KEEP_AFTER_CHANGE = 0.1  # of the step model's evidence kept after a plant change
QUEUE_TURNS = 3  # the recent queue kept, per replica


@dataclass(frozen=True)
class ModelState:
    step: StepModel = field(default_factory=StepModel)
    demand: Demand = field(default_factory=Demand)
    residual: Cusum = field(default_factory=Cusum)
    epoch: int = 0
    degraded_until: float | None = None
    degraded_since: float | None = None  # the first alarm of the degraded episode
    degraded_why: str = ""
    degraded_gap: float = 0.0  # the last alarm's step time over the model's, less one
    planned: tuple[float, ...] = ()  # times of planned changes in the last hour
    queue: tuple[float, ...] = ()  # waiting per replica, the latest turns (newest last)
    observed_until: float | None = None
    replicas: int = 1  # replicas in the latest window
    changes: tuple[str, ...] = field(default=(), compare=False)  # this turn's change points

    def fit(self) -> Fit | None:
        return self.step.fit()

    def per_replica(self) -> Demand:
        """The demand one replica sees: the service's arrivals spread over its replicas."""
        return replace(self.demand, rate=self.demand.rate / max(1, self.replicas))

    def degraded(self, now: float) -> bool:
        return self.degraded_until is not None and now < self.degraded_until

    def slower(self, now: float) -> float:
        """How many times the model's step a degraded plant's takes (1: not slower)."""
        return 1 + self.degraded_gap if self.degraded(now) and self.degraded_gap > 0 else 1.0

    def queue_growing(self) -> bool:
        q = self.queue
        return len(q) >= 3 and q[-1] > q[-2] > q[-3] and q[-1] >= 1.0

    def ingest(self, w: Window | None, now: float) -> ModelState:
        """Learn from the window since the last turn (None: nothing new)."""
        s = replace(self, changes=(), observed_until=now)
        if w is None or w.replicas == 0 or w.span_seconds <= 0:
            return s
        if w.padding != s.step.padding:
            # Fitted on batches padded otherwise (graphs captured since, or at other sizes):
            # its statistics are of other features, so it starts again.
            s = replace(s, step=StepModel(padding=w.padding), epoch=s.epoch + 1,
                        changes=(*s.changes, "the replicas' CUDA-graph sizes changed"))  # fmt: skip
        s = s._residual(w, now)
        demand, changed = s.demand.ingest(w)
        queue = (*s.queue, w.per_replica(w.waiting))[-QUEUE_TURNS:]
        s = replace(
            s, step=s.step.ingest(w.steps, now), demand=demand, queue=queue, replicas=w.replicas
        )
        if changed:
            s = replace(s, epoch=s.epoch + 1, changes=(*s.changes, *changed))
        return s

    def _residual(self, w: Window, now: float) -> ModelState:
        fit = self.step.fit()
        # The cells with MIN_CELL_STEPS each; where none has, every cell, however thin,
        # when together they make one cell's worth. A machine 4x slower runs a quarter of
        # the steps, spread over the batches its growing queue passes through: no cell
        # reached MIN_CELL_STEPS for 105 s of a W7 neighbour, while the latency guardrail
        # blamed the batch and lowered. Thin cells only then: beside thick ones they add
        # noise (a false +33 % alarm on the KV-bound CPU plant).
        observed = [o for o in map(cell_observation, w.steps) if o is not None] or [
            o for c in w.steps if (o := cell_observation(c, min_steps=1)) is not None
        ]
        if fit is None or sum(n for _, _, n in observed) < MIN_CELL_STEPS:
            return self
        seconds = sum(y * n for _, y, n in observed)
        predicted = sum(fit.mean(x[1], x[2] * 1000, x[3] * 100) * n for x, _, n in observed)
        if predicted <= 0:
            return self
        gap = seconds / predicted - 1
        cusum, side = self.residual.update(gap, RESIDUAL_DRIFT + fit.misfit, RESIDUAL_THRESHOLD)
        if side is None:
            return replace(self, residual=cusum)
        why = f"step time {'above' if side == 'up' else 'below'} the model by {gap:+.0%}"
        return replace(
            self,
            residual=cusum,
            step=self.step.forget(KEEP_AFTER_CHANGE),
            epoch=self.epoch + 1,
            degraded_until=now + SETTLE_SECONDS,
            degraded_since=self.degraded_since if self.degraded(now) else now,
            degraded_why=why,
            degraded_gap=gap,
            changes=(*self.changes, f"plant changed: {why}"),
        )

    def planned_in_last_hour(self, now: float) -> int:
        return sum(1 for t in self.planned if now - t < 3600)

    def with_planned(self, now: float) -> ModelState:
        return replace(self, planned=(*(t for t in self.planned if now - t < 3600), now))

    def to_status(self) -> dict:
        fit = self.fit()
        out = {
            "step": self.step.to_status(),
            "demand": self.demand.to_status(),
            "residualCusum": self.residual.to_status(),
            "epoch": self.epoch,
            "planned": list(self.planned),
            "queue": [round(q, 3) for q in self.queue],
            "observedUntil": self.observed_until,
            "replicas": self.replicas,
            "degradedUntil": self.degraded_until,
            "degradedSince": self.degraded_since,
            "degradedReason": self.degraded_why or None,
            "degradedGap": round(self.degraded_gap, 4),
        }
        if fit is not None:
            out["fit"] = fit.to_status()
        return out

    @classmethod
    def from_status(cls, d: dict) -> ModelState:
        return cls(
            step=StepModel.from_status(d["step"]),
            demand=Demand.from_status(d["demand"]),
            residual=Cusum.from_status(d.get("residualCusum", (0, 0))),
            epoch=int(d.get("epoch", 0)),
            degraded_until=_maybe(d.get("degradedUntil")),
            degraded_since=_maybe(d.get("degradedSince")),
            degraded_why=str(d.get("degradedReason") or ""),
            degraded_gap=float(d.get("degradedGap") or 0.0),
            planned=tuple(float(t) for t in d.get("planned", ())),
            queue=tuple(float(q) for q in d.get("queue", ())),
            observed_until=_maybe(d.get("observedUntil")),
            replicas=int(d.get("replicas", 1)),
        )


def _maybe(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None
