"""The step-cost counters of a replica's /metrics (names.STEP_COUNTERS), by batch bucket and
phase: read from each scrape, increased over a window (counter resets handled, as
observe.py's ``increase`` does), and summed over replicas."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from batchpilot import names

StepKey = tuple[float, str]  # (batch "le", phase)
# Values of one label set, one per names.STEP_COUNTERS, in that order.
StepValues = Sequence[float]

_INDEX = {name: i for i, name in enumerate(names.STEP_COUNTERS)}


@dataclass(frozen=True)
class StepCell:
    """Steps of one batch bucket and phase over a window: how many ran, how long they took,
    and what they carried (sums over those steps). ``batch_le`` is the bucket's upper bound
    on the step's sequences (math.inf past the last); ``phase`` "decode" (no prompt tokens)
    or "mixed"."""

    batch_le: float
    phase: str
    steps: float = 0.0
    seconds: float = 0.0
    sequences: float = 0.0
    decode_sequences: float = 0.0
    prefill_tokens: float = 0.0
    context_tokens: float = 0.0

    @property
    def key(self) -> StepKey:
        return (self.batch_le, self.phase)

    @property
    def values(self) -> StepValues:
        return (self.steps, self.seconds, self.sequences, self.decode_sequences,
                self.prefill_tokens, self.context_tokens)  # fmt: skip


MAX_GRAPH_SIZES = 256  # more capture sizes than any server has: not a server's label


@dataclass(frozen=True)
class Padding:
    """How a replica pads its steps (names.DECODE_GRAPHS_INFO): a step of n decoding
    sequences runs as the smallest of ``sizes`` that holds n, one past the largest as it is;
    only decode-only steps unless ``all_steps``. No sizes: nothing is padded."""

    sizes: tuple[int, ...] = ()
    all_steps: bool = False

    @classmethod
    def of(cls, labels: dict[str, str]) -> Padding:
        """From the family's labels; an odd label costs only this (no padding), as an odd KV
        layout label costs only that field."""
        values = labels.get(names.GRAPH_SIZES_LABEL, "").split(",")
        if len(values) > MAX_GRAPH_SIZES or not all(v.isdigit() and len(v) <= 6 for v in values):
            return cls()
        steps = labels.get(names.GRAPH_STEPS_LABEL) == names.GRAPH_STEPS_ALL
        return cls(tuple(sorted({int(v) for v in values})), steps)

    def batch(self, decodes: float, prefill_tokens: float) -> float:
        """The batch a step of ``decodes`` sequences (a mean over steps, too) costs."""
        if not self.sizes or decodes <= 0 or (prefill_tokens > 0 and not self.all_steps):
            return decodes
        return next((size for size in self.sizes if size >= decodes), decodes)

    def to_status(self) -> dict:
        return {"sizes": list(self.sizes), "allSteps": self.all_steps}

    @classmethod
    def from_status(cls, d: dict | None) -> Padding:
        if not d:
            return cls()
        return cls(tuple(int(v) for v in d.get("sizes", ())), bool(d.get("allSteps", False)))


NO_PADDING = Padding()


def add_step_sample(cells: dict[StepKey, list[float]], sample: Any) -> bool:
    """Add one parsed sample (prometheus_client's) to ``cells`` if it is a step counter's,
    summed over the other labels (model_name). False when it is not one."""
    i = _INDEX.get(sample.name)
    if i is None:
        return False
    labels = sample.labels
    key = (float(labels[names.STEP_BATCH_LABEL]), labels[names.STEP_PHASE_LABEL])
    cell = cells.setdefault(key, [0.0] * len(names.STEP_COUNTERS))
    cell[i] += sample.value
    return True


def _is_reset(prev: dict[StepKey, StepValues], cur: dict[StepKey, StepValues]) -> bool:
    """Judged on the whole family set, so the cells stay consistent with each other: any
    counter that fell, or a label set that vanished, means the process counted anew."""
    for key, before in prev.items():
        after = cur.get(key)
        if after is None or any(a < b for a, b in zip(after, before, strict=True)):
            return True
    return False


def step_increase(readings: Sequence[dict[StepKey, StepValues]]) -> tuple[StepCell, ...]:
    """Per label set, the increase of each step counter over consecutive readings; cells
    with no step in the window are left out."""
    total: dict[StepKey, list[float]] = {}
    for prev, cur in pairwise(readings):
        base = {} if _is_reset(prev, cur) else prev
        for key, after in cur.items():
            before = base.get(key, (0.0,) * len(after))
            cell = total.setdefault(key, [0.0] * len(after))
            for i, (a, b) in enumerate(zip(after, before, strict=True)):
                cell[i] += a - b
    return _cells(total)


def merge_steps(parts: Iterable[Iterable[StepCell]]) -> tuple[StepCell, ...]:
    """Replicas' cells summed by (batch bucket, phase)."""
    total: dict[StepKey, list[float]] = {}
    for part in parts:
        for cell in part:
            into = total.setdefault(cell.key, [0.0] * len(names.STEP_COUNTERS))
            for i, value in enumerate(cell.values):
                into[i] += value
    return _cells(total)


def _cells(total: dict[StepKey, list[float]]) -> tuple[StepCell, ...]:
    return tuple(
        StepCell(batch_le, phase, *values)
        for (batch_le, phase), values in sorted(total.items())
        if any(values)
    )
