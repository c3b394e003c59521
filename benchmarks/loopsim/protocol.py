"""The loop review's pre-registered simulator protocol (§5.1): plants x workloads x starts x
seeds, the loop against every fixed setting on the same arrivals.

    python -m benchmarks.loopsim.protocol --plants benchmarks/loopsim/plants/*.json \\
        --workloads benchmarks/loopsim/workloads/*.json --seeds 20 \\
        --out benchmarks/results/loop-v3-<date>.json
    python -m benchmarks.loopsim.protocol --quick            # 2 seeds, runs a tenth as long
    python -m benchmarks.loopsim.protocol --autoscaled ...   # 2-6 replicas at 2x load

Per plant x workload x seed: every grid setting fixed (tuning off), then the loop (tuning
on, autoscaling off) from each of the workload's starts: "under" (the plant's start),
"best" (the held-out best fixed), "over" (top max_num_seqs, the worse budget). Scores and
pass criteria: protocol_score.py. Plants and workloads: SCHEMA.md. Run it from the
repository root (``-m``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from multiprocessing import Pool
from pathlib import Path

from benchmarks.loopsim import protocol_score as score
from benchmarks.loopsim.plant_spec import load_plant
from benchmarks.loopsim.protocol_sim import Arm, run_arm
from benchmarks.loopsim.scenarios import Setting
from benchmarks.loopsim.workload_spec import load_workload

HERE = Path(__file__).parent


def run_all(arms: list[Arm], jobs: int) -> list[dict]:
    """Every arm's result, in the order given; the costliest are handed out first."""
    order = sorted(range(len(arms)), key=lambda i: -arms[i].cost)
    results: list[dict | None] = [None] * len(arms)
    if jobs <= 1:
        for i in order:
            results[i] = run_arm(arms[i])
        return results
    started = time.perf_counter()
    with Pool(jobs) as pool:
        done = pool.imap(run_arm, [arms[i] for i in order], chunksize=1)
        for n, (i, result) in enumerate(zip(order, done, strict=True), 1):
            results[i] = result
            if n % max(1, len(arms) // 10) == 0 or n == len(arms):
                print(f"{n}/{len(arms)} runs, {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
    return results


def _setting(plant, label: str) -> Setting:
    return next(s for s in plant.grid() if s.label == label)


def fixed_arms(plants, workloads, seeds, args, load=1.0) -> dict[tuple, Arm]:
    replicas = args.replicas
    return {
        (p.name, w.name, seed, s.label): Arm(
            p, w, seed, s, replicas=replicas, load=load * replicas, scale=args.duration_scale,
            keep_trace=w.kind == "step",
        )
        for p in plants for w in workloads for seed in range(seeds) for s in p.grid()
    }  # fmt: skip


def baselines(plant, fixed: dict[int, dict[str, float]], seed: int) -> dict[str, str]:
    own = fixed[seed]
    return {
        "best": max(own, key=own.__getitem__),
        "held_out": score.held_out_best(fixed, seed),
        "static": score.static_max(plant),
        "under": plant.start.label,
        "over": score.over_provisioned(plant, fixed),
    }


def goodputs(fixed: dict[tuple, dict], plant, workload, seeds: int) -> dict[int, dict]:
    return {
        seed: {s.label: fixed[(plant.name, workload.name, seed, s.label)]["goodput"]
               for s in plant.grid()}
        for seed in range(seeds)
    }  # fmt: skip


def start_label(labels: dict[str, str], start: str) -> str:
    return labels["held_out"] if start == "best" else labels[start]


def protocol(plants, workloads, args) -> dict:
    seeds, starts = args.seeds, set(args.starts)
    arms = fixed_arms(plants, workloads, seeds, args)
    fixed = dict(zip(arms, run_all(list(arms.values()), args.jobs), strict=True))
    loop_arms, labels = {}, {}
    for p in plants:
        for w in workloads:
            table = goodputs(fixed, p, w, seeds)
            for seed in range(seeds):
                labels[(p.name, w.name, seed)] = base = baselines(p, table, seed)
                for start in [s for s in w.starts if s in starts] or w.starts[:1]:
                    loop_arms[(p.name, w.name, start, seed)] = Arm(
                        p, w, seed, _setting(p, start_label(base, start)), tuning=True,
                        replicas=args.replicas, load=args.replicas,
                        scale=args.duration_scale, start=start, keep_trace=w.kind == "step",
                    )  # fmt: skip
    loops = dict(zip(loop_arms, run_all(list(loop_arms.values()), args.jobs), strict=True))
    return {**_rows_and_cells(plants, workloads, fixed, loops, labels),
            "run_seconds": _run_seconds(fixed, loops)}  # fmt: skip


def _run_seconds(fixed: dict, loops: dict) -> dict:
    """CPU-bound seconds spent per plant/workload, fixed arms and loop arms apart (for
    budgeting a larger run)."""
    out: dict = defaultdict(lambda: {"fixed": 0.0, "loop": 0.0})
    for kind, runs in (("fixed", fixed), ("loop", loops)):
        for key, result in runs.items():
            out[f"{key[0]}/{key[1]}"][kind] += round(result["wall_seconds"], 2)
    return dict(out)


def _rows_and_cells(plants, workloads, fixed, loops, labels) -> dict:
    rows, by_cell = [], defaultdict(list)
    specs = {(p.name, w.name): (p, w) for p in plants for w in workloads}
    for (plant, workload, start, seed), loop in loops.items():
        p, w = specs[(plant, workload)]
        base = labels[(plant, workload, seed)]
        own = {s.label: fixed[(plant, workload, seed, s.label)] for s in p.grid()}
        picked = {**base, "start": start_label(base, start)}
        row = {"plant": plant, "plant_label": p.label, "workload": workload,
               "workload_id": w.id, "start": start, "start_setting": picked["start"],
               "seed": seed, "held_out_best": base["held_out"], "static_max": base["static"],
               **score.score_row(loop, own, picked, w)}  # fmt: skip
        row = {k: score.finite(v) if isinstance(v, float) else v for k, v in row.items()}
        rows.append(row)
        by_cell[(plant, workload, start)].append(row)
    cells = []
    for (plant, workload, start), cell_rows in by_cell.items():
        p, w = specs[(plant, workload)]
        cells.append({"plant": plant, "plant_label": p.label, "workload": workload,
                      "workload_id": w.id, "start": start,
                      **score.score_cell(cell_rows, w, p)})  # fmt: skip
    return {"rows": rows, "cells": cells}


def autoscaled(plants, workloads, args) -> dict:
    """2-6 replicas at 2x load: the loop (tuning and scaling, from the plant's start) vs
    the scaler alone at the held-out best fixed setting (of the one-replica grid)."""
    workloads = [w for w in workloads if w.autoscaled]
    seeds, scale = args.seeds, args.duration_scale
    one = argparse.Namespace(replicas=1, duration_scale=scale)
    arms = fixed_arms(plants, workloads, seeds, one)
    fixed = dict(zip(arms, run_all(list(arms.values()), args.jobs), strict=True))
    pairs = {}
    for p in plants:
        for w in workloads:
            table = goodputs(fixed, p, w, seeds)
            for seed in range(seeds):
                best = _setting(p, score.held_out_best(table, seed))
                common = {"autoscaling": True, "replicas": 2, "load": 2.0, "scale": scale}
                pairs[(p.name, w.name, seed, "scaler")] = Arm(p, w, seed, best, **common)
                pairs[(p.name, w.name, seed, "loop")] = Arm(
                    p, w, seed, p.start, tuning=True, start="under", **common
                )
    runs = dict(zip(pairs, run_all(list(pairs.values()), args.jobs), strict=True))
    return _autoscaled_rows(plants, workloads, seeds, runs)


def _autoscaled_rows(plants, workloads, seeds, runs) -> dict:
    rows, cells = [], []
    for p in plants:
        for w in workloads:
            mine = []
            for seed in range(seeds):
                s, loop = (
                    runs[(p.name, w.name, seed, "scaler")],
                    runs[(p.name, w.name, seed, "loop")],
                )
                mine.append({
                    "plant": p.name, "workload": w.name, "workload_id": w.id, "seed": seed,
                    "loop_goodput": round(loop["goodput"], 3),
                    "scaler_goodput": round(s["goodput"], 3),
                    "goodput_over_scaler": score.ratio(loop["goodput"], s["goodput"]),
                    "loop_replica_hours": round(loop["replica_seconds"] / 3600, 3),
                    "scaler_replica_hours": round(s["replica_seconds"] / 3600, 3),
                    "replica_hours_over_scaler": score.ratio(loop["replica_seconds"],
                                                             s["replica_seconds"]),
                    "knob_changes": len(loop["knob_changes"]),
                    "scale_downs_on_failed_scrapes": loop["scale_downs_on_failed_scrapes"],
                })  # fmt: skip
            rows += mine
            cells.append({"plant": p.name, "workload": w.name, "workload_id": w.id,
                          **score.score_autoscaled_cell(mine)})  # fmt: skip
    return {"rows": rows, "cells": cells}


def provenance(args) -> dict:
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        lscpu = ""
    flags = next((line.split(":", 1)[1].split() for line in lscpu.splitlines()
                  if line.startswith("Flags:")), [])  # fmt: skip
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", "benchmarks/loopsim", "operator")),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_flags": [f for f in flags if f.startswith(("avx", "amx"))],
        "args": {k: _plain(v) for k, v in vars(args).items()},
    }  # fmt: skip


def _plain(value):
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def _fmt(x, digits: int = 2) -> str:
    if isinstance(x, bool):
        return "ok" if x else "FAIL"
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def table(results: dict) -> str:
    """One line a cell: the scores, then the criteria that failed."""
    if results["mode"] == "autoscaled":
        head = "plant             workload         goodput÷scaler  replica-h÷scaler  pass"
        lines = [head] + [
            f"{c['plant']:<17} {c['workload']:<16} {_fmt(c['median_goodput_over_scaler']):>14}"
            f"  {_fmt(c['median_replica_hours_over_scaler']):>16}  {_fmt(c['pass'])}"
            for c in results["cells"]
        ]
        return "\n".join(lines)
    head = ("plant             workload         start  ÷best  lb    2nd   worst÷start quiet "
            "÷static pass  failed")  # fmt: skip
    lines = [head]
    for c in results["cells"]:
        failed = ",".join(k for k, v in c["criteria"].items() if v is False)
        lines.append(
            f"{c['plant']:<17} {c['workload']:<16} {c['start']:<6} "
            f"{_fmt(c['median_over_best'])}  {_fmt(c['lower_bound_over_best'])}  "
            f"{_fmt(c['second_half_median'])}  {_fmt(c['worst_over_start']):>11} "
            f"{_fmt(c['quiet_changes_max']):>5} {_fmt(c['median_over_static_max']):>7} "
            f"{_fmt(c['pass']):<5} {failed}"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--plants", nargs="+", type=Path,
                   default=sorted((HERE / "plants").glob("*.json")))  # fmt: skip
    p.add_argument("--workloads", nargs="+", type=Path,
                   default=sorted((HERE / "workloads").glob("*.json")))  # fmt: skip
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--starts", nargs="+", choices=("under", "best", "over"),
                   default=["under", "best", "over"],
                   help="only these starts of each workload's own (a workload with none of "
                        "them runs its first)")  # fmt: skip
    p.add_argument("--replicas", type=int, default=1,
                   help="replicas of every arm, the load scaled to match (tuning only)")  # fmt: skip
    p.add_argument("--autoscaled", action="store_true",
                   help="2-6 replicas at 2x load on the workloads marked autoscaled")  # fmt: skip
    p.add_argument("--duration-scale", type=float, default=1.0,
                   help="x every time in the workloads (a smoke run: 0.1)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="2 seeds, --duration-scale 0.1")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.duration_scale = 2, 0.1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    plants = [load_plant(path) for path in args.plants]
    workloads = [load_workload(path) for path in args.workloads]
    started = time.perf_counter()
    # Read before the run: the code that runs is the code imported now, and a run takes
    # long enough for the tree to move on under it.
    origin = provenance(args)
    mode = "autoscaled" if args.autoscaled else "tuning"
    body = (autoscaled if args.autoscaled else protocol)(plants, workloads, args)
    results = {**origin, "mode": mode, "seeds": args.seeds,
               "thresholds": score.THRESHOLDS, **body,
               "wall_seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    print(table(results))
    passed = sum(c["pass"] for c in results["cells"])
    print(f"\n{passed}/{len(results['cells'])} cells pass; {results['wall_seconds']} s wall",
          file=sys.stderr)  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
