"""Observation and actuation faults, injected between the loop and the replicas.

Replicas are named by the order they were created (``sim://replica-0`` is the first), so a
fault sticks to one pod: the blind replica stays blind until it is rolled away."""

from __future__ import annotations

import random
from dataclasses import dataclass

DROPPED = "dropped"
BLIND = "blind: scrape timed out"
REJECTED = "rejected: HTTP 500 from /admin/config"


@dataclass(frozen=True)
class Faults:
    drop_fraction: float = 0.0  # of all scrapes, at random
    blind: tuple[str, ...] = ()  # replicas whose scrapes always fail
    rejecting: tuple[str, ...] = ()  # replicas whose admin API refuses every change

    @property
    def any(self) -> bool:
        return bool(self.drop_fraction or self.blind or self.rejecting)


NONE = Faults()
# Issue 20's three faults at once: 30% of scrapes lost, the first replica blind, the
# second refusing live changes.
ALL = Faults(0.3, blind=("sim://replica-0",), rejecting=("sim://replica-1",))


class FaultInjector:
    def __init__(self, faults: Faults, seed: int):
        self.faults = faults
        self._rng = random.Random(f"faults-{seed}")

    def scrape_error(self, url: str) -> str | None:
        """Why this scrape fails, or None when it gets through."""
        if url in self.faults.blind:
            return BLIND
        if self.faults.drop_fraction and self._rng.random() < self.faults.drop_fraction:
            return DROPPED
        return None

    def apply_error(self, url: str) -> str | None:
        return REJECTED if url in self.faults.rejecting else None
