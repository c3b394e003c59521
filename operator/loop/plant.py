"""The model of one replica's engine step, fitted online: step seconds =
a + b x decoding sequences + c x their context (thousands of tokens) + d x prefill tokens
(hundreds), the form of the seed document's cost model and of the simulator's plants.

It is fitted by weighted least squares on the servers' step counters
(``batchpilot:engine_step_*_total`` by batch bucket and phase, observe.StepCell): each cell
of a window is one observation of the mean step, weighted by its steps. The sufficient
statistics decay with a half-life, so a machine that changed is refitted, and they live in
status.tuning.model: the operator keeps no memory of its own.

A server that replays decode steps from CUDA graphs runs a batch of n as the capture size
that holds it (names.DECODE_GRAPHS_INFO): the model is fitted and asked at that padded
batch (observe_steps.Padding), so that 65 slots where 64 and 128 are captured cost what 128
do. A cell's mean batch is padded as one batch: the step-counter buckets are powers of two,
so where the capture sizes are too, a cell's steps share their padded size; where they are
finer (the server's multiples of 16 past 8) a cell's steps may pad to two sizes, and the
misfit takes what padding its mean misses.

Uncertainty, so that the planner can take the safe side: the coefficients' standard error
from the weighted residuals, plus the cells' relative misfit (a plant that is not this
model, such as a superlinear batch or CUDA-graph padding, shows there and widens every
bound). Predictions past twice the largest batch observed are refused, not extrapolated.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from batchpilot.operator.loop.observe import StepCell
from batchpilot.operator.loop.observe_steps import NO_PADDING, Padding

K = 4  # features: 1, decodes, context (k tokens), prefill (100 tokens)
HALF_LIFE_SECONDS = 1800.0
MIN_CELL_STEPS = 20  # a cell of fewer steps is a handful of outliers, not a mean
MIN_STEPS = 200  # before this many steps the model is not ready to plan
Z = 2.0  # the bounds' width in standard errors
MIN_MISFIT = 0.05  # a bound is never tighter than this share of the prediction
EXTRAPOLATION = 2.0  # no prediction past this x the largest decode batch observed


def features(decodes: float, context_tokens: float, prefill_tokens: float,
             padding: Padding = NO_PADDING) -> tuple[float, ...]:  # fmt: skip
    batch = padding.batch(decodes, prefill_tokens)
    return (1.0, batch, context_tokens / 1000.0, prefill_tokens / 100.0)


def cell_observation(
    cell: StepCell, min_steps: float = MIN_CELL_STEPS
) -> tuple[tuple[float, ...], float, float] | None:
    """(features, mean step seconds, weight) of one cell, None when too thin to count."""
    if cell.steps < max(min_steps, 1) or cell.seconds <= 0:
        return None
    s = cell.steps
    x = features(cell.decode_sequences / s, cell.context_tokens / s, cell.prefill_tokens / s)
    return x, cell.seconds / s, s


@dataclass(frozen=True)
class StepModel:
    """Decayed sufficient statistics of the fit, and what was observed."""

    xtx: tuple[float, ...] = (0.0,) * (K * K)
    xty: tuple[float, ...] = (0.0,) * K
    yty: float = 0.0
    steps: float = 0.0  # decayed weight
    max_batch: float = 0.0  # largest mean decode batch of a counted cell
    min_batch: float = math.inf
    updated: float | None = None  # time of the last ingest
    padding: Padding = NO_PADDING  # how the replicas pad the batches it was fitted on

    @property
    def ready(self) -> bool:
        return self.steps >= MIN_STEPS

    def decayed(self, now: float, half_life: float = HALF_LIFE_SECONDS) -> StepModel:
        if self.updated is None or now <= self.updated:
            return replace(self, updated=now)
        f = 0.5 ** ((now - self.updated) / half_life)
        return replace(self.forget(f), updated=now)

    def forget(self, keep: float) -> StepModel:
        """Keep ``keep`` of the evidence: after a change point the old plant is history."""
        return replace(
            self,
            xtx=tuple(v * keep for v in self.xtx),
            xty=tuple(v * keep for v in self.xty),
            yty=self.yty * keep,
            steps=self.steps * keep,
        )

    def ingest(self, cells: Iterable[StepCell], now: float) -> StepModel:
        m = self.decayed(now)
        xtx, xty, yty, steps = list(m.xtx), list(m.xty), m.yty, m.steps
        hi, lo = m.max_batch, m.min_batch
        for obs in filter(None, map(cell_observation, cells)):
            raw, y, w = obs
            x = features(raw[1], raw[2] * 1000, raw[3] * 100, m.padding)
            for i in range(K):
                xty[i] += w * x[i] * y
                for j in range(K):
                    xtx[i * K + j] += w * x[i] * x[j]
            yty += w * y * y
            steps += w
            hi, lo = max(hi, raw[1]), min(lo, raw[1])
        return replace(
            m, xtx=tuple(xtx), xty=tuple(xty), yty=yty, steps=steps, max_batch=hi, min_batch=lo
        )

    # -- the fit

    def fit(self) -> Fit | None:
        if not self.ready:
            return None
        beta = _nonnegative_lstsq(self.xtx, self.xty)
        if beta is None:
            return None
        b = beta
        xtxb = [sum(self.xtx[i * K + j] * b[j] for j in range(K)) for i in range(K)]
        ssr = max(
            0.0,
            self.yty
            - 2 * sum(b[i] * self.xty[i] for i in range(K))
            + sum(b[i] * xtxb[i] for i in range(K)),
        )
        sigma = math.sqrt(ssr / self.steps)  # per step, seconds
        mean_y = self.xty[0] / self.steps
        misfit = sigma / mean_y if mean_y > 0 else 1.0
        return Fit(tuple(beta), max(MIN_MISFIT, misfit), sigma, _inverse(self.xtx), self)

    # -- status

    def to_status(self) -> dict:
        return {
            "xtx": [round(v, 9) for v in self.xtx],
            "xty": [round(v, 9) for v in self.xty],
            "yty": round(self.yty, 9),
            "steps": round(self.steps, 3),
            "maxBatch": round(self.max_batch, 3),
            "minBatch": round(self.min_batch, 3) if math.isfinite(self.min_batch) else None,
            "updated": self.updated,
            "padding": self.padding.to_status(),
        }

    @classmethod
    def from_status(cls, d: dict) -> StepModel:
        xtx, xty = tuple(map(float, d["xtx"])), tuple(map(float, d["xty"]))
        if len(xtx) != K * K or len(xty) != K:
            raise ValueError("a step model of another shape")
        lo = d.get("minBatch")
        updated = d.get("updated")
        return cls(
            xtx, xty, float(d["yty"]), float(d["steps"]), float(d["maxBatch"]),
            float(lo) if lo is not None else math.inf,
            float(updated) if updated is not None else None,
            Padding.from_status(d.get("padding")),
        )  # fmt: skip


@dataclass(frozen=True)
class Fit:
    """The fitted coefficients and their uncertainty."""

    beta: tuple[float, ...]
    misfit: float  # relative RMS residual of the cells
    sigma: float  # RMS residual, seconds
    inverse: tuple[float, ...] | None  # (X'WX)^-1, None when singular
    model: StepModel

    @property
    def max_batch(self) -> float:
        """The largest decode batch the fit may speak for."""
        return EXTRAPOLATION * max(1.0, self.model.max_batch)

    @property
    def identified(self) -> bool:
        """Were different batch sizes seen, as the replicas run them (padded)? One batch
        size cannot split a from b."""
        pad, m = self.model.padding, self.model
        return pad.batch(m.max_batch, 0) - pad.batch(m.min_batch, 0) >= 2

    def mean(self, decodes: float, context: float, prefill: float) -> float:
        x = features(decodes, context, prefill, self.model.padding)
        if not self.identified and x[1] != self._padded_batch_seen:
            # The pessimistic reading of one batch size: step time in proportion to it.
            return self._proportional(x)
        return sum(b * xi for b, xi in zip(self.beta, x, strict=True))

    @property
    def _padded_batch_seen(self) -> float | None:
        """The one capture size every batch observed ran as, if so: there the fit's other
        terms (context, prefill) still speak, though the batch's own cannot be told from
        the base (overload at 129-256 slots, all run as 256)."""
        pad, m = self.model.padding, self.model
        if not pad.sizes or not math.isfinite(m.min_batch):
            return None
        seen = pad.batch(m.max_batch, 0)
        return seen if pad.batch(m.min_batch, 0) == seen and seen in pad.sizes else None

    def upper(self, decodes: float, context: float, prefill: float) -> float | None:
        """A bound the true mean step exceeds rarely; None past the extrapolation limit."""
        if decodes > self.max_batch:
            return None
        mean = self.mean(decodes, context, prefill)
        return mean + self._width(decodes, context, prefill, mean)

    def lower(self, decodes: float, context: float, prefill: float) -> float:
        mean = self.mean(decodes, context, prefill)
        return max(0.0, mean - self._width(decodes, context, prefill, mean))

    def _width(self, decodes: float, context: float, prefill: float, mean: float) -> float:
        x = features(decodes, context, prefill, self.model.padding)
        se = 0.0
        if self.inverse is not None:
            var = sum(x[i] * self.inverse[i * K + j] * x[j] for i in range(K) for j in range(K))
            se = math.sqrt(max(0.0, var)) * self.sigma
        return Z * (se + self.misfit * mean)

    def _proportional(self, x: Sequence[float]) -> float:
        m = self.model
        mean_y = m.xty[0] / m.steps
        mean_batch = m.xtx[1] / m.steps  # row 0, column 1: the weighted mean batch
        return mean_y * max(x[1], 1.0) / max(mean_batch, 1.0)

    def to_status(self) -> dict:
        a, b, c, d = self.beta
        return {
            "stepBaseSeconds": round(a, 6),
            "perSequenceSeconds": round(b, 7),
            "perThousandContextTokensSeconds": round(c, 7),
            "perHundredPrefillTokensSeconds": round(d, 7),
            "relativeMisfit": round(self.misfit, 4),
            "largestBatchObserved": round(self.model.max_batch, 1),
            "identified": self.identified,
        }


# --------------------------------------------------------------------------- linear algebra


def _solve(a: list[list[float]], y: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(y)
    m = [[*row, y[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [vr - f * vc for vr, vc in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _sub(xtx: Sequence[float], xty: Sequence[float], active: list[int]):
    a = [[xtx[i * K + j] for j in active] for i in active]
    return a, [xty[i] for i in active]


def _nonnegative_lstsq(xtx: Sequence[float], xty: Sequence[float]) -> list[float] | None:
    """Least squares with every coefficient >= 0 (a step never gets faster with more work):
    drop the most negative coefficient and refit until none is negative. Features never
    seen (a zero column) are dropped first, and so are features that never varied (a batch
    every step ran padded to one capture size): their cost is in the base, and dropping
    the last column instead, as collinearity does below, would drop the prefill's."""
    active = [i for i in range(K) if xtx[i * K + i] > 0 and not _constant(xtx, i)]
    while active:
        solution = _solve(*_sub(xtx, xty, active))
        if solution is None:
            active = active[:-1]  # collinear (a feature constant so far): drop the last
            continue
        worst = min(range(len(active)), key=lambda k: solution[k])
        if solution[worst] >= 0:
            beta = [0.0] * K
            for k, i in enumerate(active):
                beta[i] = solution[k]
            return beta
        del active[worst]
    return None


def _constant(xtx: Sequence[float], i: int) -> bool:
    """Whether feature ``i`` (not the base) took one value in every observation: its
    weighted variance, from the sums, is nothing against its square."""
    n, square = xtx[0], xtx[i * K + i]
    if i == 0 or n <= 0:
        return False
    mean = xtx[i] / n  # row 0, column i
    return square / n - mean * mean <= 1e-9 * (square / n)


def _inverse(xtx: Sequence[float]) -> tuple[float, ...] | None:
    a = [[xtx[i * K + j] for j in range(K)] for i in range(K)]
    cols = []
    for k in range(K):
        col = _solve(a, [1.0 if i == k else 0.0 for i in range(K)])
        if col is None:
            return None
        cols.append(col)
    return tuple(cols[j][i] for i in range(K) for j in range(K))
