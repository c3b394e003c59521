"""Noisy neighbours that depend on the time: an episodic one (W7 of the protocol), next to
``replica.StepNoise``'s i.i.d. one.

``step_factor`` is what a replica multiplies a step's seconds by; it draws from the
replica's RNG exactly as the i.i.d. neighbour always did (one draw a step), so runs with a
``StepNoise`` are unchanged.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class EpisodicNoise:
    """Another tenant that is on for ``on_seconds`` of every ``period_seconds``, starting
    ``offset_seconds`` into each period: while it is on, every step takes ``factor`` times
    as long (4x for 10 min of every 30 min in the protocol)."""

    period_seconds: float
    on_seconds: float
    factor: float
    offset_seconds: float = 0.0

    def active(self, t: float) -> bool:
        phase = (t - self.offset_seconds) % self.period_seconds
        return t >= self.offset_seconds and phase < self.on_seconds

    def factor_at(self, t: float) -> float:
        return self.factor if self.active(t) else 1.0

    def episodes(self, duration: float) -> list[tuple[float, float]]:
        """The [start, end) of every episode that begins before ``duration``."""
        out, start = [], self.offset_seconds
        while start < duration:
            out.append((start, min(start + self.on_seconds, duration)))
            start += self.period_seconds
        return out


def step_factor(noise, t: float, rng: random.Random) -> float:
    """What a step that starts at ``t`` is multiplied by: a time-dependent neighbour's
    factor, or an i.i.d. one's (``probability``, ``factor``) drawn from ``rng``."""
    factor_at = getattr(noise, "factor_at", None)
    if factor_at is not None:
        return factor_at(t)
    return noise.factor if rng.random() < noise.probability else 1.0
