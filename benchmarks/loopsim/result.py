"""What one simulated run produced, and the scores read from it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from benchmarks.loopsim.replica import Finished

# Event reasons that are not tuning decisions. Everything else the loop posts (trials,
# verdicts, and whatever reasons a later loop adds) counts as one.
SCALING = ("ScaledUp", "ScaledDown", "ScaleDownHeld")
OBSERVATION = ("LoopBlind", "LoopSighted", "AdminApplyFailed")
VERDICTS = ("Kept", "Reverted", "Abandoned")  # endings of reasons that judge a trial


@dataclass(frozen=True)
class TracePoint:
    time: float
    offered_per_second: float
    waiting: int
    running: int
    swapped: int
    ready_replicas: int
    desired_replicas: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    kv_cache_dtype: str
    preemptions: int  # cumulative, over every replica that ever ran
    itl_p99: float | None
    goodput: float  # tokens/s of requests that finished in this interval within the SLO
    scrape_failures: int


# No generated repr: asyncio.run formats its task's result on the way out, and a run's
# result holds every request.
@dataclass(repr=False)
class SimResult:
    trace: list[TracePoint]
    events: list[tuple[float, str, str]]  # (time, reason, message) as the operator posts them
    status: dict
    duration: float = 0.0
    slo: tuple[float, float] = (2.0, 0.1)  # (TTFT, mean TPOT) targets, seconds
    arrived: int = 0
    requests: list[Finished] = field(default_factory=list)
    # ScaledDown events posted in a turn where some Ready replica's scrape had failed.
    scale_downs_on_failed_scrapes: int = 0

    @property
    def finished(self) -> int:
        return len(self.requests)

    def changes(self, reason_prefix: str) -> list[tuple[float, str, str]]:
        return [e for e in self.events if e[1].startswith(reason_prefix)]

    def meets_slo(self, r: Finished) -> bool:
        ttft, itl = self.slo
        return r.ttft <= ttft and r.tpot <= itl

    def goodput(self, since: float = 0.0, until: float | None = None) -> float:
        """Tokens/s of requests that finished in [since, until) and met both targets."""
        return self._rate(since, until, self.meets_slo)

    def throughput(self, since: float = 0.0, until: float | None = None) -> float:
        return self._rate(since, until, lambda r: True)

    def _rate(self, since: float, until: float | None, counts) -> float:
        until = self.duration if until is None else until
        tokens = sum(r.output_len for r in self.requests if since <= r.finish < until and counts(r))
        return tokens / max(until - since, 1e-9)

    def reasons(self, since: float = 0.0) -> Counter[str]:
        return Counter(reason for t, reason, _ in self.events if t >= since)

    def decisions(self, since: float = 0.0) -> list[tuple[float, str, str]]:
        """Tuning decisions (trials and verdicts): every Event after ``since`` that is
        neither scaling nor about what the loop could see or apply."""
        return [e for e in self.events if e[0] >= since and e[1] not in SCALING + OBSERVATION]

    def trials(self, since: float = 0.0) -> list[tuple[float, str, str]]:
        """Decisions that change something new (not verdicts on an earlier one)."""
        return [e for e in self.decisions(since) if not e[1].endswith(VERDICTS)]

    def verdicts(self, suffix: str) -> int:
        return sum(reason.endswith(suffix) for _, reason, _ in self.events)
