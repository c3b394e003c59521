"""Change points: a two-sided CUSUM on a standardized statistic (Page's test). The loop acts
on a change, not on every window: a workload that changed is re-planned, a machine that
changed (the step model's residual) is frozen, not tuned.

The thresholds are set for false alarms on a steady workload at most once in 10 hours
(docs/tuning.md: with k 0.5 and h 10 on an i.i.d. standard normal statistic, Siegmund's
approximation gives an average run of about 140,000 turns per side; six sides at 15 s a turn
is about 98 hours), and a 30 % step in a 1 request/s arrival rate is seen in about 4 min.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

DRIFT = 0.5  # k: the shift, in standard deviations, that the statistic is tuned to see
THRESHOLD = 10.0  # h


@dataclass(frozen=True)
class Cusum:
    up: float = 0.0
    down: float = 0.0

    def update(
        self, z: float, drift: float = DRIFT, threshold: float = THRESHOLD
    ) -> tuple[Cusum, str | None]:
        """The state after ``z``, and "up"/"down" when that side crossed (then reset)."""
        up = max(0.0, self.up + z - drift)
        down = max(0.0, self.down - z - drift)
        if up > threshold:
            return Cusum(), "up"
        if down > threshold:
            return Cusum(), "down"
        return Cusum(up, down), None

    def to_status(self) -> list[float]:
        return [round(self.up, 3), round(self.down, 3)]

    @classmethod
    def from_status(cls, d: object) -> Cusum:
        up, down = d  # type: ignore[misc]
        return cls(float(up), float(down))
