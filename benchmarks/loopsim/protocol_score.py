"""The protocol's scores (docs: the loop review's §5.1): per loop run (a row) and per
plant x workload x start (a cell), with each pass criterion recorded on its own.

Baselines, all on the seed's own arrivals: the per-seed best fixed (hindsight); the
held-out best (the grid setting with the best median goodput over the other seeds; the
seed itself when it is the only one); static max (top max_num_seqs, larger budget); the
start. The second-half ratio divides by the best fixed goodput over the second half (the
hindsight oracle of that half).
"""

from __future__ import annotations

import math
import random
import statistics

HOUR = 3600.0
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20240501
ROLLING_SECONDS = 300.0  # W2: the rolling goodput's window
RECOVERED = 0.95  # W2: within 5% of the best fixed's rolling goodput

THRESHOLDS = {
    "median_over_best": 0.95,
    "lower_bound_over_best": 0.93,
    "second_half_median_over_best": 0.97,
    "worst_over_start": 1.00,  # the workload's worst_vs_start_min (W11: 0.98)
    "static_max_applies_below": 0.9,
    "over_static_max": 1.05,
}


def ratio(a: float, b: float) -> float | None:
    """a / b; None where b served nothing within the SLO and a did (unbounded)."""
    if b > 0:
        return a / b
    return 1.0 if a == 0 else None


def finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 4)


def _values(xs) -> list[float]:
    """Ratios for statistics: an unbounded one (None) counts as infinitely good."""
    return [math.inf if x is None else x for x in xs]


def held_out_best(fixed: dict[int, dict[str, float]], seed: int) -> str:
    """The label with the best median goodput over the seeds other than ``seed``."""
    others = [s for s in fixed if s != seed] or [seed]
    labels = list(fixed[seed])
    return max(labels, key=lambda k: statistics.median(fixed[s][k] for s in others))


def over_provisioned(plant, fixed: dict[int, dict[str, float]]) -> str:
    """Top max_num_seqs with the budget whose median goodput there is the lower."""
    top = max(plant.max_num_seqs)
    labels = [s.label for s in plant.grid() if s.max_num_seqs == top]
    return min(labels, key=lambda k: (statistics.median(f[k] for f in fixed.values()), k))


def static_max(plant) -> str:
    return next(
        s.label for s in plant.grid()
        if s.max_num_seqs == max(plant.max_num_seqs) and s.max_num_batched_tokens == max(plant.budgets)
    )  # fmt: skip


def quiet_changes(times: list[float], windows, duration: float, per: str) -> int:
    """Knob changes inside the quiet windows (fractions of ``duration``): the most in any
    hour (per "hour"), or all of them (per "run")."""
    spans = [(a * duration, b * duration) for a, b in windows]
    quiet = sorted(t for t in times if any(a <= t < b for a, b in spans))
    if per == "run":
        return len(quiet)
    return max((sum(t <= u < t + HOUR for u in quiet) for t in quiet), default=0)


def episode_changes(changes: list, episodes: list) -> tuple[int, int]:
    """(capacity-reducing changes during episodes, the most changes in one episode)."""
    reducing = sum(r for t, r in changes if any(a <= t < b for a, b in episodes))
    per = [sum(a <= t < b for t, _ in changes) for a, b in episodes]
    return reducing, max(per, default=0)


def _rolling(trace: list[float], n: int) -> list[float]:
    out, total = [], 0.0
    for i, g in enumerate(trace):
        total += g - (trace[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def recovery_seconds(loop: list[float], best: list[float], at: float, interval: float):
    """Seconds from the step at ``at`` to the start of the first 5-min window, wholly after
    the step, in which the loop's goodput is within 5% of the best fixed's; None if none
    is."""
    n = max(1, round(ROLLING_SECONDS / interval))
    mine, theirs = _rolling(loop, n), _rolling(best, n)
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        start = (i + 1) * interval - ROLLING_SECONDS  # trace point i closes an interval
        if start >= at and a >= RECOVERED * b:
            return start - at
    return None


def bootstrap_lower(values: list[float], resamples: int = BOOTSTRAP_RESAMPLES) -> float:
    """The 2.5th percentile of the median over ``resamples`` resamples (fixed RNG seed)."""
    rng = random.Random(BOOTSTRAP_SEED)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)]


def score_row(loop: dict, fixed: dict[str, dict], labels: dict[str, str], spec) -> dict:
    """One loop run against its seed's fixed arms. ``labels``: best, held_out, static,
    start (grid labels)."""
    goodput = {k: v["goodput"] for k, v in fixed.items()}
    second = {k: v["goodput_second_half"] for k, v in fixed.items()}
    best = labels["best"]
    times = [t for t, _ in loop["knob_changes"]]
    reducing, per_episode = episode_changes(loop["knob_changes"], loop.get("episodes", []))
    row = {
        "best_fixed": best,
        "best_fixed_goodput": round(goodput[best], 3),
        "loop_goodput": round(loop["goodput"], 3),
        "loop_goodput_second_half": round(loop["goodput_second_half"], 3),
        "over_best": ratio(loop["goodput"], goodput[best]),
        "over_best_second_half": ratio(loop["goodput_second_half"], max(second.values())),
        "over_held_out": ratio(loop["goodput"], goodput[labels["held_out"]]),
        "over_static_max": ratio(loop["goodput"], goodput[labels["static"]]),
        "over_start": ratio(loop["goodput"], goodput[labels["start"]]),
        "static_over_best": ratio(goodput[labels["static"]], goodput[best]),
        "knob_changes": len(times),
        "quiet_changes": quiet_changes(times, spec.quiet_windows, loop["duration"],
                                       spec.quiet_per) if spec.quiet_windows else None,
        "episode_reducing_changes": reducing if "episodes" in loop else None,
        "episode_max_changes": per_episode if "episodes" in loop else None,
        "recovery_seconds": None,
        "final_setting": loop["final_setting"],
    }  # fmt: skip
    if spec.kind == "step" and "trace_goodput" in loop:
        at = spec.params["at"] * loop["duration"]
        best_trace = fixed[best]["trace_goodput"]
        row["recovery_seconds"] = recovery_seconds(
            loop["trace_goodput"], best_trace, at, loop["interval"]
        )
    return row


def _criteria(stats: dict, spec, plant) -> dict:
    t = THRESHOLDS
    applies = stats["static_over_best_median"] < t["static_max_applies_below"]
    out = {
        "median_over_best": stats["median_over_best"] >= t["median_over_best"],
        "lower_bound_over_best": stats["lower_bound_over_best"] >= t["lower_bound_over_best"],
        "second_half_median": stats["second_half_median"] >= t["second_half_median_over_best"],
        "worst_over_start": stats["worst_over_start"] >= spec.worst_vs_start_min,
        "quiet_changes": None if stats["quiet_changes_max"] is None
        else stats["quiet_changes_max"] <= spec.quiet_max_changes,
        "static_max": None if not applies
        else stats["median_over_static_max"] >= t["over_static_max"],
        "episodes": None if stats["episode_reducing_max"] is None
        else stats["episode_reducing_max"] == 0 and stats["episode_changes_max"] <= 1,
        "recovery": None if spec.kind != "step"
        else stats["recovery_median"] <= plant.recovery_limit,
    }  # fmt: skip
    return out


def _max_or_none(rows: list[dict], key: str) -> int | None:
    values = [r[key] for r in rows if r[key] is not None]
    return max(values) if values else None


def score_cell(rows: list[dict], spec, plant) -> dict:
    """Rows of one plant x workload x start, every seed."""
    best = _values(r["over_best"] for r in rows)
    recovery = [math.inf if r["recovery_seconds"] is None else r["recovery_seconds"]
                for r in rows]  # fmt: skip
    stats = {
        "seeds": len(rows),
        "median_over_best": statistics.median(best),
        "lower_bound_over_best": bootstrap_lower(best),
        "second_half_median": statistics.median(_values(r["over_best_second_half"] for r in rows)),
        "worst_over_start": min(_values(r["over_start"] for r in rows)),
        "median_over_held_out": statistics.median(_values(r["over_held_out"] for r in rows)),
        "median_over_static_max": statistics.median(_values(r["over_static_max"] for r in rows)),
        "static_over_best_median": statistics.median(_values(r["static_over_best"] for r in rows)),
        "quiet_changes_max": _max_or_none(rows, "quiet_changes"),
        "episode_reducing_max": _max_or_none(rows, "episode_reducing_changes"),
        "episode_changes_max": _max_or_none(rows, "episode_max_changes"),
        "recovery_median": statistics.median(recovery),
        "knob_changes_median": statistics.median(r["knob_changes"] for r in rows),
    }
    criteria = _criteria(stats, spec, plant)
    cell = {k: finite(v) if isinstance(v, float) else v for k, v in stats.items()}
    cell["criteria"] = criteria
    cell["pass"] = all(v for v in criteria.values() if v is not None)
    return cell


def score_autoscaled_cell(rows: list[dict]) -> dict:
    goodput = statistics.median(_values(r["goodput_over_scaler"] for r in rows))
    hours = statistics.median(_values(r["replica_hours_over_scaler"] for r in rows))
    failed = sum(r["scale_downs_on_failed_scrapes"] for r in rows)
    criteria = {"goodput": goodput >= 0.95, "replica_hours": hours <= 1.10,
                "no_scale_down_on_failed_scrape": failed == 0}  # fmt: skip
    return {
        "seeds": len(rows),
        "median_goodput_over_scaler": finite(goodput),
        "median_replica_hours_over_scaler": finite(hours),
        "scale_downs_on_failed_scrapes": failed,
        "criteria": criteria,
        "pass": all(criteria.values()),
    }
