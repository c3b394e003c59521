"""One protocol cell over time: the loop (tuning on, from a start) and a fixed setting on
the same arrivals, plotted as stacked panels (arrivals and the model's capacity, queue,
max_num_seqs in force with the loop's decisions, goodput per interval).

    python -m benchmarks.loopsim.timeline --plant benchmarks/loopsim/plants/cpu-mismatch.json \\
        --workload benchmarks/loopsim/workloads/w03-diurnal.json --seed 0 --start under \\
        --out docs/loop-v3-sim-timeline.png [--json out.json] [--fixed 64,128] [--minutes 25]

The fixed setting is the seed's best of the plant's grid (every grid setting is run, as
the protocol does, and the highest goodput kept) unless ``--fixed N[,BUDGET]`` names one.
``--minutes`` stops both runs early: the first minutes of the same run, not a shorter
workload. Arms are built as protocol_sim.run_arm builds them; the decisions are what the
real loop decided each turn (``loop.turn.ClosedLoop.run_once``'s outcome).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from batchpilot.operator.loop.turn import CAPACITY_KINDS
from benchmarks.loopsim import protocol_score as score
from benchmarks.loopsim.plant_spec import Plant, load_plant
from benchmarks.loopsim.protocol import baselines
from benchmarks.loopsim.protocol_sim import Arm, RecordingServiceSim, arm_sim
from benchmarks.loopsim.result import SimResult
from benchmarks.loopsim.scenarios import Setting
from benchmarks.loopsim.workload_spec import Built, load_workload

# Decision categories, in legend order, and their colours.
COLOURS = {
    "guardrail raise": "tab:red",
    "guardrail lower": "tab:blue",
    "planned trial": "tab:orange",
    "planned kept": "tab:green",
    "planned reverted": "tab:purple",
    "abandoned": "black",
    "held": "0.55",
}
SMOOTH_TURNS = 8  # the goodput panel's rolling mean: 2 minutes at the 15 s loop period


@dataclass(frozen=True)
class Turn:
    """What the loop decided in one turn, and the model's figures it decided on."""

    time: float
    action: str | None  # None: tuning off (a fixed arm)
    kind: str | None
    reason: str
    max_num_seqs: int | None  # the decision's settings, in force after it
    plan_max_num_seqs: int | None
    plan_capacity: float | None  # requests/s a replica completes within the SLO at the plan
    capacity: float | None  # the same at the settings in force (what the autoscaler sizes)
    arrivals: float | None  # the tuner's arrival rate (5-min half-life, reset on a change)
    sustained: float | None  # the autoscaler's (15-min half-life, never reset)
    live_max_num_seqs: tuple[int, ...]  # on each replica not draining


class TimelineSim(RecordingServiceSim):
    """RecordingServiceSim that keeps every turn's outcome (decision, plan, capacity)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run_once = self.loop.run_once

        async def recorded(*a, **kw):
            self._outcome = await run_once(*a, **kw)
            return self._outcome

        self.loop.run_once = recorded

    def _reset(self, seed: int) -> None:
        super()._reset(seed)
        self.turns: list[Turn] = []
        self._outcome = None

    def _point(self, status: dict, arrived: int, good: int, failures: int):
        self.turns.append(self._turn_record(status))
        self._outcome = None
        return super()._point(status, arrived, good, failures)

    def _turn_record(self, status: dict) -> Turn:
        o = self._outcome
        demand = ((status.get("tuning") or {}).get("model") or {}).get("demand") or {}
        d = o.tuning if o is not None else None
        plan = (d.inputs.get("plan") if d is not None else None) or {}
        live = tuple(p.engine.max_num_seqs for p in self.pods if not p.draining)
        return Turn(
            self.now, d and d.action, d and d.kind, d.reason if d else "",
            d and d.settings.max_num_seqs, plan.get("maxNumSeqs"),
            plan.get("capacityRequestsPerSecond"), o and o.capacity,
            demand.get("arrivalsPerSecond"), demand.get("sustainedArrivalsPerSecond"), live,
        )  # fmt: skip


@dataclass
class Run:
    arm: Arm
    built: Built
    result: SimResult
    turns: list[Turn]
    interval: float
    wall_seconds: float


def simulate(arm: Arm, minutes: float | None = None) -> Run:
    """One arm, built as protocol_sim.run_arm builds it; ``minutes`` stops it early."""
    started = time.perf_counter()
    built, sim = arm_sim(arm, TimelineSim)
    duration = built.duration if minutes is None else min(built.duration, 60.0 * minutes)
    result = sim.run(built.workload, duration, arm.seed)
    return Run(arm, built, result, sim.turns, sim.interval, time.perf_counter() - started)


def parse_setting(plant: Plant, text: str) -> Setting:
    """``N`` (the plant's start budget) or ``N,BUDGET``."""
    parts = [int(x) for x in text.split(",")]
    return Setting(parts[0], parts[1] if len(parts) > 1 else plant.start.max_num_batched_tokens)


def best_fixed(plant: Plant, workload, seed: int, minutes: float | None) -> tuple[Run, dict]:
    """The seed's best grid setting, picked as the protocol picks it (protocol.baselines'
    "best"), with every grid setting's goodput."""
    runs = {s.label: simulate(Arm(plant, workload, seed, s), minutes) for s in plant.grid()}
    table = {seed: {label: r.result.goodput() for label, r in runs.items()}}
    best = baselines(plant, table, seed)["best"]
    return runs[best], table[seed]


# -- the series


def good_requests(run: Run) -> list[float]:
    """Requests/s that finished in each interval within both SLO targets."""
    n, counts = len(run.result.trace), [0] * len(run.result.trace)
    for r in run.result.requests:
        i = int(r.finish // run.interval)
        if i < n and run.result.meets_slo(r):
            counts[i] += 1
    return [c / run.interval for c in counts]


def expected_rate(run: Run) -> list[float | None]:
    rate = getattr(run.built.workload, "rate", None)
    return [rate(p.time) if rate else None for p in run.result.trace]


def series(run: Run) -> dict:
    trace = run.result.trace
    return {
        "time_s": [p.time for p in trace],
        "arrivals_per_s": [p.offered_per_second for p in trace],
        "expected_rate_per_s": expected_rate(run),
        "waiting": [p.waiting for p in trace],
        "running": [p.running for p in trace],
        "max_num_seqs": [p.max_num_seqs for p in trace],
        "goodput_tokens_per_s": [p.goodput for p in trace],
        "good_requests_per_s": good_requests(run),
        "plan_capacity_per_s": [t.plan_capacity for t in run.turns],
        "capacity_in_force_per_s": [t.capacity for t in run.turns],
        "model_arrivals_per_s": [t.arrivals for t in run.turns],
        "sustained_arrivals_per_s": [t.sustained for t in run.turns],
    }


# -- the decisions


def category(turn: Turn) -> str:
    if turn.action == "guard":  # a raise adds capacity, as the arbiter counts it
        return "guardrail raise" if turn.kind in CAPACITY_KINDS else "guardrail lower"
    return {"try": "planned trial", "canary": "planned trial", "keep": "planned kept",
            "rollout": "planned kept", "revert": "planned reverted",
            "abandon": "abandoned"}[turn.action]  # fmt: skip


def held_kind(reason: str) -> str | None:
    """What a hold held back, its numbers blanked ("a plan is due, held: dwell"), or None
    where the turn held nothing back."""
    head, held, rest = reason.split(";")[0].partition("held")
    if not held:
        return None
    why = re.split(r"[:;(,]", rest.removeprefix(": "))[0]
    return re.sub(r"\d+(\.\d+)?", "#", f"{head}{held}: {why}".strip())


def decisions(run: Run) -> list[dict]:
    """Every change the tuner made, and the first hold of each kind (every turn's decision
    is in the JSON's turns)."""
    out, before, holds = [], run.arm.setting.max_num_seqs, set()
    for t in run.turns:
        if t.action is None or t.max_num_seqs is None:
            continue
        after, held = t.max_num_seqs, held_kind(t.reason)
        if t.action != "hold":
            out.append(_decision(t, category(t), before, after))
        elif held is not None and held not in holds:
            out.append(_decision(t, "held", before, after))
            holds.add(held)
        before = after
    return out


def change_points(run: Run) -> list[dict]:
    """The model's change points (the loop's WorkloadChanged and PlantDegraded Events)."""
    return [{"time_s": t, "reason": reason, "message": message}
            for t, reason, message in run.result.events
            if reason in ("WorkloadChanged", "PlantDegraded")]  # fmt: skip


def _decision(t: Turn, cat: str, before: int, after: int) -> dict:
    return {"time_s": t.time, "category": cat, "action": t.action, "kind": t.kind,
            "from": before, "to": after, "reason": t.reason}  # fmt: skip


# -- the plot


def commit() -> str:
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    dirty = git("status", "--porcelain", "--", "benchmarks/loopsim", "operator")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")


def plot(cells: list[dict], commit_id: str, out: Path) -> None:
    """A column of four panels per cell, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, len(cells), figsize=(3 + 9 * len(cells), 12), sharex="col",
                             squeeze=False, gridspec_kw={"height_ratios": [1, 1, 1.3, 1]})  # fmt: skip
    for column, cell in zip(axes.T, cells, strict=True):
        _column(column, cell)
    fig.suptitle(f"closed loop v3 in simulation, commit {commit_id}", fontsize=12)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)


def _save(fig, out: Path) -> None:
    """A 256-colour PNG: a third of the RGBA one's size, the plot's colours kept."""
    from io import BytesIO

    from PIL import Image  # matplotlib's own dependency

    buffer = BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    image = Image.open(buffer).convert("RGB")
    out.parent.mkdir(parents=True, exist_ok=True)
    image.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(out, optimize=True)


def _column(axes, cell: dict) -> None:
    loop, fixed = cell["loop"]["series"], cell["fixed"]["series"]
    minutes = [t / 60 for t in loop["time_s"]]
    _arrivals(axes[0], minutes, loop, cell["change_points"])
    _queue(axes[1], minutes, loop, fixed, cell)
    _knob(axes[2], minutes, loop, cell)
    _goodput(axes[3], minutes, loop, fixed, cell)
    for d in cell["decisions"]:
        if d["category"] != "held":
            for ax in axes:
                ax.axvline(d["time_s"] / 60, color=COLOURS[d["category"]], lw=0.6, alpha=0.35)
    axes[-1].set_xlabel("simulated minutes")
    axes[0].set_title(_title(cell), fontsize=10)


def _title(s: dict) -> str:
    return (f"plant {s['plant']}, workload {s['workload']}, seed {s['seed']}, start "
            f"{s['start']} ({s['start_setting']})\ngoodput over the run, loop ÷ fixed "
            f"{s['fixed_setting']}: {_ratio(s['loop_over_fixed'])} (tokens/s within the SLO; "
            f"{_ratio(s['loop_over_fixed_requests'])} in requests)")  # fmt: skip


def _ratio(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.3f}"


def _arrivals(ax, minutes, loop, changes) -> None:
    for c in changes:
        ax.axvline(c["time_s"] / 60, color="black", ls=":", lw=1.0)
        ax.annotate(c["message"], (c["time_s"] / 60, 0.02), xycoords=("data", "axes fraction"),
                    xytext=(3, 0), textcoords="offset points", fontsize=8)  # fmt: skip
    ax.plot(minutes, loop["arrivals_per_s"], color="0.6", lw=0.8, label="arrivals (per 15 s)")
    if loop["expected_rate_per_s"][0] is not None:
        ax.plot(minutes, loop["expected_rate_per_s"], color="black", lw=1.2,
                label="workload's rate")  # fmt: skip
    ax.plot(minutes, loop["model_arrivals_per_s"], color="tab:cyan", lw=1.2,
            label="tuner's arrival rate")  # fmt: skip
    ax.plot(minutes, loop["plan_capacity_per_s"], color="tab:orange", ls="--", lw=1.2,
            label="model's capacity at the plan")  # fmt: skip
    ax.set_ylabel("requests/s")
    ax.legend(loc="upper left", fontsize=8, ncol=2)


def _queue(ax, minutes, loop, fixed, s) -> None:
    ax.plot(minutes, loop["waiting"], color="tab:red", lw=1.0, label="loop: waiting")
    ax.plot(minutes, fixed["waiting"], color="tab:gray", lw=1.0,
            label=f"fixed {s['fixed_setting']}: waiting")  # fmt: skip
    ax.set_ylabel("queue (requests)")
    ax.legend(loc="upper left", fontsize=8)


def _knob(ax, minutes, loop, s) -> None:
    ax.step(minutes, loop["max_num_seqs"], where="post", color="black", lw=1.4,
            label="loop: max_num_seqs in force")  # fmt: skip
    ax.plot(minutes, loop["running"], color="0.7", lw=0.7, label="loop: running")
    ax.axhline(s["fixed_max_num_seqs"], color="tab:gray", ls=":", lw=1.0,
               label=f"fixed: {s['fixed_max_num_seqs']}")  # fmt: skip
    shown = set()
    for n, d in enumerate(s["decisions"], 1):
        cat = d["category"]
        ax.scatter(d["time_s"] / 60, d["to"], color=COLOURS[cat], zorder=3, s=40,
                   marker="o" if cat != "held" else "v",
                   label=None if cat in shown else cat)  # fmt: skip
        ax.annotate(str(n), (d["time_s"] / 60, d["to"]), textcoords="offset points",
                    xytext=(-3, 6 if n % 2 else -13), fontsize=8)  # fmt: skip
        shown.add(cat)
    ax.set_ylabel("max_num_seqs (numbered: decisions)")
    ax.set_ylim(0, 1.12 * max(max(loop["max_num_seqs"]), s["fixed_max_num_seqs"]))
    ax.legend(loc="upper left", fontsize=8, ncol=2)


def _rolling(values: list[float], n: int) -> list[float]:
    return [sum(values[max(0, i - n + 1) : i + 1]) / (i + 1 - max(0, i - n + 1))
            for i in range(len(values))]  # fmt: skip


def _goodput(ax, minutes, loop, fixed, s) -> None:
    for data, colour, name in ((loop, "tab:red", "loop"),
                               (fixed, "tab:gray", f"fixed {s['fixed_setting']}")):  # fmt: skip
        good = data["good_requests_per_s"]
        ax.plot(minutes, good, color=colour, lw=0.5, alpha=0.4)
        ax.plot(minutes, _rolling(good, SMOOTH_TURNS), color=colour, lw=1.4,
                label=f"{name} (2-min mean)")  # fmt: skip
    ax.set_ylabel("requests/s within SLO")
    ax.legend(loc="upper left", fontsize=8)


# -- the run


def summarise(loop: Run, fixed: Run, grid: dict | None, commit_id: str) -> dict:
    arm = loop.arm
    return {
        "plant": arm.plant.name, "workload": arm.workload.name, "seed": arm.seed,
        "start": arm.start, "start_setting": arm.setting.label, "commit": commit_id,
        "duration_s": loop.result.duration, "interval_s": loop.interval,
        "fixed_setting": fixed.arm.setting.label,
        "fixed_max_num_seqs": fixed.arm.setting.max_num_seqs,
        "grid_goodput": grid,
        "loop_over_fixed": score.ratio(loop.result.goodput(), fixed.result.goodput()),
        "loop_over_fixed_requests": score.ratio(sum(good_requests(loop)),
                                                sum(good_requests(fixed))),
        "decisions": decisions(loop), "change_points": change_points(loop),
        "loop": _arm_summary(loop), "fixed": _arm_summary(fixed),
    }  # fmt: skip


def _arm_summary(run: Run) -> dict:
    r = run.result
    return {"goodput_tokens_per_s": r.goodput(), "arrived": r.arrived,
            "met_slo": sum(map(r.meets_slo, r.requests)), "finished": r.finished,
            "wall_seconds": round(run.wall_seconds, 2), "series": series(run),
            "turns": [asdict(t) for t in run.turns] if run.arm.tuning else None}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--plant", type=Path, required=True)
    p.add_argument("--workload", type=Path, nargs="+", required=True,
                   help="one column of panels each")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", choices=("under", "fixed"), default="under",
                   help="under: the plant's start; fixed: the fixed setting's")  # fmt: skip
    p.add_argument("--fixed", default=None,
                   help="N or N,BUDGET: the fixed arm (default: the seed's best of the grid)")  # fmt: skip
    p.add_argument("--minutes", type=float, default=None, help="stop every run this early")
    p.add_argument("--out", type=Path, required=True, help="the PNG")
    p.add_argument("--json", type=Path, default=None, help="the series and decisions")
    return p.parse_args(argv)


def cell(plant: Plant, workload, args, commit_id: str) -> dict:
    """The loop and the fixed arm on one workload, summarised."""
    started = time.perf_counter()
    if args.fixed is None:
        fixed, grid = best_fixed(plant, workload, args.seed, args.minutes)
    else:
        setting = parse_setting(plant, args.fixed)
        fixed, grid = simulate(Arm(plant, workload, args.seed, setting), args.minutes), None
    start = plant.start if args.start == "under" else fixed.arm.setting
    loop_arm = Arm(plant, workload, args.seed, start, tuning=True, start=args.start)
    out = summarise(simulate(loop_arm, args.minutes), fixed, grid, commit_id)
    return {**out, "wall_seconds": round(time.perf_counter() - started, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    plant = load_plant(args.plant)
    commit_id = commit()  # before the runs: the code that runs is the code imported now
    cells = [cell(plant, load_workload(w), args, commit_id) for w in args.workload]
    plot(cells, commit_id, args.out)
    wall = round(time.perf_counter() - started, 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        body = {"commit": commit_id, "wall_seconds": wall, "cells": cells}
        args.json.write_text(json.dumps(body, indent=1) + "\n")
    for c in cells:
        _print(c)
    print(f"{wall} s wall, the plot included")
    return 0


def _print(s: dict) -> None:
    print(f"{s['plant']} {s['workload']} seed {s['seed']}: loop ÷ fixed {s['fixed_setting']} "
          f"{_ratio(s['loop_over_fixed'])} ({s['wall_seconds']} s wall)")  # fmt: skip
    for n, d in enumerate(s["decisions"], 1):
        print(f"{n:>3} {d['time_s']:>7.0f} s {d['category']:<16} {d['from']:>3} -> "
              f"{d['to']:<3} {d['reason'][:110]}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
