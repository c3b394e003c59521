"""The summary of a benchmarks/tune.py run, from its windows: the calibration that chose
the fixed arm, the paired repeats, the soak and the hog, and the pass criteria (abba.py).
Pure: windows in, a dict out."""

from __future__ import annotations

import statistics

from benchmarks.realtune import abba


def calibration(windows: list[dict]) -> dict[str, dict]:
    """Per fixed value, its goodput over every calibration window it ran in."""
    out: dict[str, list[float]] = {}
    for w in windows:
        for a in w["arms"]:
            out.setdefault(a["arm"], []).append(a["goodput_whole"])
    return {k: {"goodput_whole": v, "median": round(statistics.median(v), 3)}
            for k, v in sorted(out.items(), key=lambda kv: int(kv[0]))}  # fmt: skip


def best_fixed(table: dict[str, dict]) -> int:
    """The value with the best median goodput (ties: the smaller value)."""
    return int(max(table, key=lambda k: (table[k]["median"], -int(k))))


def by_arm(window: dict) -> dict[str, dict]:
    return {a["arm"]: a for a in window["arms"]}


def tuned_changes(window: dict) -> dict:
    t = by_arm(window)["T"]
    seconds = window["t_end"] - window["t_score"]
    return abba.changes_per_hour([d["time"] for d in t["decisions"]], seconds)


def repeat_row(r: int, window: dict) -> dict:
    arms = by_arm(window)
    t = arms["T"]
    return {
        "repeat": r,
        "servers": {a["arm"]: a["server"] for a in window["arms"]},
        "goodput_whole": {k: a["goodput_whole"] for k, a in arms.items()},
        "goodput_second_half": {k: a["goodput_second_half"] for k, a in arms.items()},
        "knob_changes": tuned_changes(window),
        "tuned_final": t["final"],
        "load_average": window.get("load_average"),
    }


def summary(repeats: list[dict], start_arm: str | None, start_calibrated: float | None,
            soak: dict | None, hog: dict | None, seed: int) -> dict:  # fmt: skip
    """``start_arm``: the arm that ran the start value beside T in every repeat ("S", or
    "F" when the start is the best fixed value); None with two servers and another best
    value, and then the start's goodput is ``start_calibrated``, from the calibration."""
    rows = [by_arm(w) for w in repeats]
    if start_arm is None:
        start = [start_calibrated] * len(rows)
        how = ("the start's calibration windows: not the same wall-clock window as the "
               "repeats, since two servers hold only T and F")  # fmt: skip
    else:
        start = [row[start_arm]["goodput_whole"] for row in rows]
        how = f"arm {start_arm}, in the same window as T"
    hog_count = None
    if hog is not None:
        hog_count = {"capacity_reducing": len(
            abba.capacity_reducing_during_hog(by_arm(hog)["T"]["decisions"]))}  # fmt: skip
    evaluated = abba.evaluate(rows, start, tuned_changes(soak) if soak else None, hog_count, seed)
    return {
        "repeats": [repeat_row(r, w) for r, w in enumerate(repeats)],
        "start_goodput_from": how,
        "changes_per_hour_tuned": [tuned_changes(w)["per_hour"] for w in repeats],
        **evaluated,
    }
