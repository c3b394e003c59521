"""The paired design of benchmarks/tune.py, pure: which server runs which arm in each
repeat, the per-repeat paired ratios, their bootstrap intervals, and the pass criteria of
the loop v3 issue's "Real servers" check (the loop review's §5.2).

Every arm of a repeat runs in the same wall-clock window on its own server, so a ratio is
taken within a repeat only: machine drift between repeats moves both arms together.
"""

from __future__ import annotations

import math
import random
import statistics

BOOTSTRAP_RESAMPLES = 4000
LEVELS = (0.025, 0.1, 0.9, 0.975)
HOUR = 3600.0

THRESHOLDS = {
    "median_paired_ratio": 0.95,
    "lower_bound_2_5": 0.90,
    "worst_over_start": 1.0,
    "soak_changes_per_hour": 2,
    "soak_seconds": 2 * HOUR,
    "hog_capacity_reducing_changes": 0,
}


def schedule(arms: list[str], repeats: int, seed: int) -> list[list[str]]:
    """Per repeat, the arm on each server (list index = server). The k rotations of
    ``arms`` over the servers in a random order and then mirrored, block after block: for
    two arms each block is ABBA or BAAB, so each arm runs on each server equally often and
    a linear drift within a block cancels out of the pairs. ``seed`` draws every block."""
    k = len(arms)
    rotations = [arms[i:] + arms[:i] for i in range(k)]
    rng = random.Random(seed)
    out: list[list[str]] = []
    while len(out) < repeats:
        order = rng.sample(rotations, k)
        out += order + order[::-1]
    return out[:repeats]


def ratio(a: float, b: float) -> float | None:
    """a / b; None when b served nothing within the SLO and a did (unbounded)."""
    if b > 0:
        return a / b
    return 1.0 if a == 0 else None


def _ordered(values: list[float | None]) -> list[float]:
    """Ratios for order statistics: an unbounded one (None) ranks above every number."""
    return [math.inf if v is None else v for v in values]


def finite(x: float) -> float | None:
    """JSON has no infinity: an unbounded figure is written as null."""
    return round(x, 4) if math.isfinite(x) else None


def bootstrap_median(
    values: list[float | None], seed: int, resamples: int = BOOTSTRAP_RESAMPLES
) -> dict[str, float | None]:
    """The median of ``values`` and the percentiles (LEVELS) of its bootstrap
    distribution: the repeats resampled with replacement ``resamples`` times."""
    xs = _ordered(values)
    if not xs:
        return {"median": None, **{f"p{100 * q:g}": None for q in LEVELS}}
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    pick = {
        f"p{100 * q:g}": finite(medians[min(resamples - 1, int(q * resamples))]) for q in LEVELS
    }
    return {"median": finite(statistics.median(xs)), **pick}


def changes_per_hour(times: list[float], seconds: float) -> dict:
    """Knob changes at ``times`` (s from the window's start) over a window of ``seconds``:
    the rate, and the count in each whole or started hour (the soak's criterion is per
    hour, so a burst is not averaged away)."""
    hours = max(1, math.ceil(seconds / HOUR))
    per_hour = [sum(1 for t in times if h * HOUR <= t < (h + 1) * HOUR) for h in range(hours)]
    return {
        "changes": len(times),
        "per_hour": round(len(times) / (seconds / HOUR), 2) if seconds > 0 else None,
        "by_hour": per_hour,
        "seconds": round(seconds, 1),
    }


def reduces_capacity(before: dict, after: dict) -> bool:
    """A change that lowers max_num_seqs or the step budget (None: the server's default,
    which a tuned value never exceeds)."""
    if after["max_num_seqs"] < before["max_num_seqs"]:
        return True
    b, a = before.get("max_num_batched_tokens"), after.get("max_num_batched_tokens")
    return a is not None and (b is None or a < b)


def capacity_reducing_during_hog(decisions: list[dict]) -> list[dict]:
    """The decisions taken while the hog was on that lowered capacity."""
    return [d for d in decisions if d["hog"] and reduces_capacity(d["before"], d["after"])]


def at_least(value: float | None, threshold: float) -> bool:
    """NaN (no repeats) is never at least anything; None is an unbounded ratio."""
    return value is None or value >= threshold


def criterion(value, threshold, passed: bool | None, note: str = "") -> dict:
    out = {"value": value, "threshold": threshold, "pass": passed}
    return out | ({"note": note} if note else {})


def paired(rows: list[dict], key: str, seed: int) -> dict:
    """T ÷ F within each repeat, on goodput ``key``; its median and bootstrap intervals."""
    ratios = [ratio(r["T"][key], r["F"][key]) for r in rows]
    return {"ratios": [None if x is None else round(x, 4) for x in ratios],
            **bootstrap_median(ratios, seed)}  # fmt: skip


def evaluate(
    rows: list[dict], start_goodput: list[float], soak: dict | None, hog: dict | None, seed: int
) -> dict:
    """The pass criteria. ``rows``: per repeat, arm label -> {"goodput_whole",
    "goodput_second_half"}; ``start_goodput``: per repeat, the start's goodput in the same
    window where it ran beside the others, else the calibration's (the caller says which);
    ``soak``: changes_per_hour of the soak's tuned arm; ``hog``: {"capacity_reducing": n}.
    A criterion that was not run is recorded with pass None, never as a pass."""
    whole = paired(rows, "goodput_whole", seed)
    half = paired(rows, "goodput_second_half", seed + 1)
    over_start = [
        ratio(r["T"]["goodput_whole"], s) for r, s in zip(rows, start_goodput, strict=True)
    ]
    worst = min(_ordered(over_start), default=math.nan)
    t = THRESHOLDS
    # A repeat where F served nothing within the SLO has no ratio worth the name (0 / 0
    # reads as 1.0): the targets are out of this machine's reach, and the pairs say nothing.
    empty = [i for i, r in enumerate(rows) if r["F"]["goodput_whole"] <= 0]
    void = f"F served nothing within the SLO in repeat(s) {empty}: not evaluable" if empty else ""
    start_void = "" if any(start_goodput) else "the start served nothing within the SLO"
    worst_value = None if math.isnan(worst) else finite(worst)
    out = {
        "median_paired_ratio": criterion(
            whole["median"], t["median_paired_ratio"],
            None if empty else at_least(whole["median"], t["median_paired_ratio"]), void,
        ),
        "lower_bound_2_5": criterion(
            whole["p2.5"], t["lower_bound_2_5"],
            None if empty else at_least(whole["p2.5"], t["lower_bound_2_5"]), void,
        ),
        "no_repeat_below_start": criterion(
            worst_value, t["worst_over_start"],
            None if start_void else at_least(worst, t["worst_over_start"]), start_void,
        ),
    }  # fmt: skip
    if soak is None:
        out["soak_changes_per_hour"] = criterion(
            None, t["soak_changes_per_hour"], None, "not run (--soak-seconds)"
        )
    else:
        most = max(soak["by_hour"])
        short = soak["seconds"] < t["soak_seconds"]
        out["soak_changes_per_hour"] = criterion(
            most, t["soak_changes_per_hour"],
            None if short else most <= t["soak_changes_per_hour"],
            f"the most changes in any hour of a {soak['seconds']:.0f} s soak"
            + ("; under 2 h it is not the issue's soak: not judged" if short else ""),
        )  # fmt: skip
    if hog is None:
        out["hog_capacity_reducing_changes"] = criterion(
            None, t["hog_capacity_reducing_changes"], None, "not run (--hog-seconds)"
        )
    else:
        n = hog["capacity_reducing"]
        out["hog_capacity_reducing_changes"] = criterion(
            n, t["hog_capacity_reducing_changes"], n <= t["hog_capacity_reducing_changes"]
        )
    return {"whole": whole, "second_half": half,
            "over_start": [None if x is None else round(x, 4) for x in over_start],
            "criteria": out}  # fmt: skip
