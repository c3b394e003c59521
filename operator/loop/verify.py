"""The no-harm test of a planned change, and the score it reads.

The score is the SLO as clients see it, per request (vLLM's and guidellm's definitions):
the share of finished requests whose mean time per output token and time to first token
met their targets, with requests still waiting past the TTFT target counted as misses, so
that a change which builds a queue is not credited before its misses are recorded. A
server given the targets counts each request against both (``batchpilot:slo_requests_*``);
otherwise the shares come from vLLM's histograms, interpolated inside the bucket that holds
each target (TPOT's buckets run 25 -> 50 ms: a 30 ms target reads a fifth of that bucket
as within, whatever it holds), and the two shares are taken as independent.

The test is paired and sequential, a non-inferiority test: with two or more replicas the
canary (chosen at random) against the other replicas over the same window; with one
replica, the window after the change against the one before it (weaker: load may differ,
docs/tuning.md says so). At each turn, the change passes when the lower confidence bound of
(attainment after - attainment before) clears -``MARGIN``, and fails when its upper bound
is below -``MARGIN`` or the canary's step time at matched batch sizes is ``STEP_SLACK`` over
the control's. A constant boundary of ``Z`` over at most 40 looks (10 min at 15 s) keeps
the one-sided error of passing a harmful change near 5 % (Pocock's constant for 40 looks).
No verdict by ``MAX_SECONDS``: not shown harmless, so it fails. A share's variance is the
binomial one, or the spread of its per-turn shares (batch means) when that is larger:
misses come in bursts (a queue, a run of long prompts), and requests counted as
independent would turn one burst into a verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchpilot.operator.loop.observe import Buckets, Window, histogram_quantile
from batchpilot.operator.loop.tuner_state import Score

MARGIN = 0.05  # non-inferiority margin on attainment
Z = 2.6
MIN_REQUESTS = 10  # per arm, before any look
MIN_SECONDS = 60.0
MAX_SECONDS = 600.0
STEP_SLACK = 1.25  # canary step time at matched batch over the control's


@dataclass(frozen=True)
class Targets:
    ttft_seconds: float
    tpot_seconds: float


def share_within(buckets: Buckets, target: float) -> float:
    """The share of a histogram's observations at or under ``target``, interpolated
    linearly inside the bucket that holds it (as histogram_quantile does). 1 when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return 1.0
    total = buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if target <= le:
            if le == float("inf") or le == lower:
                return below / total
            return (below + (count - below) * (target - lower) / (le - lower)) / total
        lower, below = le, count
    return 1.0


def score(w: Window, targets: Targets) -> Score:
    # Waiting past the TTFT target: misses already, though no first token says so yet.
    overdue = w.waiting_now if w.oldest_waiting_seconds > targets.ttft_seconds else 0.0
    if w.slo_requests > 0:  # the server judged each request: exact, both targets at once
        requests = w.slo_requests + overdue
        attainment = w.slo_requests_met / requests
    else:  # from vLLM's histograms, interpolated inside the buckets that hold the targets
        finished = w.tpot_buckets[-1][1] if w.tpot_buckets else 0.0
        ttft_seen = w.ttft_buckets[-1][1] if w.ttft_buckets else 0.0
        within = finished * share_within(w.tpot_buckets, targets.tpot_seconds)
        ttft_share = share_within(w.ttft_buckets, targets.ttft_seconds)
        requests = finished + overdue
        ttft_ok = ttft_share * ttft_seen / (ttft_seen + overdue) if ttft_seen + overdue else 1.0
        attainment = (within / finished if finished else 1.0) * ttft_ok
    return Score(
        requests=requests,
        attainment=attainment,
        throughput=w.per_replica(w.generation_tokens_per_second),
        running=w.per_replica(w.running),
        waiting=w.per_replica(w.waiting),
        seconds=w.span_seconds,
        tpot_p90=histogram_quantile(0.9, w.tpot_buckets),
        ttft_p99=histogram_quantile(0.99, w.ttft_buckets),
    )


def step_ratio(trial: Window, control: Window) -> float | None:
    """The trial's step seconds over what the control's steps of the same batch bucket and
    phase would have taken: the same work, so load and routing do not enter."""
    mean = {(c.batch_le, c.phase): c.seconds / c.steps for c in control.steps if c.steps > 0}
    spent = expected = 0.0
    for c in trial.steps:
        if c.steps > 0 and (c.batch_le, c.phase) in mean:
            spent += c.seconds
            expected += c.steps * mean[(c.batch_le, c.phase)]
    return spent / expected if expected > 0 else None


@dataclass(frozen=True)
class Verdict:
    decided: bool
    passed: bool
    why: str


def test(
    before: Score, after: Score, elapsed: float, ratio: float | None = None, paired: bool = True
) -> Verdict:
    """One look of the sequential non-inferiority test. ``paired``: the control runs in
    the same window (a canary), so both arms' variances count; otherwise the window before
    the change is a fixed benchmark level (its requests are not added to), and only the
    trial's variance counts: a benchmark of a few requests must not make the test
    undecidable."""
    facts = (
        f"SLO attainment {before.attainment:.3f} ({before.requests:.0f} requests) -> "
        f"{after.attainment:.3f} ({after.requests:.0f})"
    )
    if ratio is not None and ratio > STEP_SLACK and elapsed >= MIN_SECONDS:
        return Verdict(True, False, f"step time at matched batch sizes {ratio:.2f}x the control's")
    if (
        after.requests < MIN_REQUESTS
        or (paired and before.requests < MIN_REQUESTS)
        or elapsed < MIN_SECONDS
    ):
        if elapsed >= MAX_SECONDS:
            return Verdict(True, False, f"{facts}: too few requests in {elapsed:.0f} s")
        return Verdict(False, False, f"{facts}: observing")
    diff = after.attainment - before.attainment
    se = math.sqrt((_variance(before) if paired else 0.0) + _variance(after))
    if diff - Z * se > -MARGIN:
        return Verdict(True, True, f"{facts}: no worse than {MARGIN:.0%} at {Z} standard errors")
    if diff + Z * se < -MARGIN:
        return Verdict(True, False, f"{facts}: worse by more than {MARGIN:.0%}")
    if elapsed >= MAX_SECONDS:
        return Verdict(True, False, f"{facts}: not shown harmless in {elapsed:.0f} s")
    return Verdict(False, False, f"{facts}: undecided")


def _variance(s: Score) -> float:
    # A binomial share, never taken as exact: at least one miss in the count's worth. Where
    # the test has seen enough turns, their spread when larger: misses come in bursts.
    p = min(max(s.attainment, 0.5 / max(s.requests, 1.0)), 1 - 0.5 / max(s.requests, 1.0))
    return max(p * (1 - p) / max(s.requests, 1.0), s.variance or 0.0)
