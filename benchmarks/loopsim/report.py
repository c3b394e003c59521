"""The evaluation's outputs: a markdown table, the JSON, the plot, and the machine."""

from __future__ import annotations

import json
import math
import platform
import subprocess
from pathlib import Path

TARGET_OF_BEST = 0.95  # issue 20: the loop's median goodput >= 0.95 x the best fixed


def machine() -> dict:
    """The CPU the evaluation ran on (it sets the wall time only: the plant is simulated)."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return {
        "model": fields.get("Model name", platform.processor()).strip(),
        "flags": [f for f in wanted if f in flags],
        "python": platform.python_version(),
    }


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def table(results: dict) -> str:
    head = (
        "| calibration | workload | loop ÷ best fixed, median (worst) | loop ÷ start, median "
        "(worst) | decisions/h | kept | reverted | decisions in the last 2 h | scale-downs "
        "with faults / without (on a failed scrape) |"
    )
    rows = [head, "|" + "---|" * 9]
    for calibration, workloads in results["cases"].items():
        for workload, r in workloads.items():
            s = r["summary"]
            best, start = s["loop_over_best"], s["loop_over_start"]
            quiet = s.get("decisions_after_convergence_max")
            rows.append(
                f"| {calibration} | {workload} "
                f"| {_fmt(best['median'])} ({_fmt(best['worst'])}) "
                f"| {_fmt(start['median'])} ({_fmt(start['worst'])}) "
                f"| {s['decisions_per_hour']:.1f} | {s['kept']} | {s['reversals']} "
                f"| {'-' if quiet is None else quiet} "
                f"| {s['fault_scale_downs']} / {s['clean_scale_downs']} "
                f"({s['scale_downs_on_failed_scrapes']}) |"
            )
    return "\n".join(rows)


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


def plot(results: dict, path: Path) -> None:
    """Per calibration, per workload: the loop's goodput over the best fixed setting's and
    over the starting setting's, median bars with the worst seed marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), squeeze=False)
    for ax, (calibration, workloads) in zip(axes[0], cases.items(), strict=True):
        names = list(workloads)
        for i, (key, label) in enumerate(
            (("loop_over_best", "÷ best fixed"), ("loop_over_start", "÷ start"))
        ):
            stats = [workloads[n]["summary"][key] for n in names]
            xs = [j + (i - 0.5) * 0.38 for j in range(len(names))]
            medians = [_finite(s["median"]) for s in stats]
            ax.bar(xs, medians, width=0.36, label=f"loop {label} (median)", color=f"C{i}")
            ax.plot(xs, [_finite(s["worst"]) for s in stats], "v", color="k", ms=5,
                    label="worst seed" if i == 0 else None)  # fmt: skip
        ax.axhline(TARGET_OF_BEST, color="C3", ls="--", lw=1, label="target 0.95 x best")
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("goodput ratio (log)")
        ax.set_title(f"{calibration}: {results['seeds']} seeds")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("benchmarks/loopsim: the closed loop's goodput within the SLO, simulated")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _finite(x: float | None) -> float:
    """A ratio for the plot: undefined ones (start served nothing) drawn at 0."""
    return x if x is not None and math.isfinite(x) else 0.0
