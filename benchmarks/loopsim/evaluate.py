"""The closed loop against fixed settings, in simulation (issue 20's evidence).

    python -m benchmarks.loopsim.evaluate --seeds 10 --out benchmarks/results/closed_loop_sim.json
    python -m benchmarks.loopsim.evaluate --quick

Per calibration x workload x seed, all on the same arrivals:
- every setting of the case's grid, fixed (tuning and autoscaling off, one replica): the
  best of them is "best fixed", the case's starting setting is "start";
- the loop: tuning on from the starting setting, autoscaling off (equal replicas);
- the fault check: autoscaling and tuning on, two replicas to start under twice the load,
  once with issue 20's three faults (30% of scrapes dropped, one replica blind, one
  rejecting live changes) and once without.
Steady load runs the loop for 30 min plus 2 h and counts the decisions in the last 2 h.
Run it from the repository root (``-m``): a PYTHONPATH with the root would shadow the
standard library's ``operator`` with the operator's directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from benchmarks.loopsim import report
from benchmarks.loopsim.faults import ALL, NONE, Faults
from benchmarks.loopsim.result import SimResult
from benchmarks.loopsim.scenarios import (
    CASES,
    CONVERGED_SECONDS,
    QUIET_SECONDS,
    SCENARIOS,
    Case,
    Scenario,
    Setting,
)
from benchmarks.loopsim.service import ServiceSim

HOUR = 3600.0


def simulate(
    case: Case,
    scenario: Scenario,
    setting: Setting,
    seed: int,
    *,
    tuning: bool = False,
    autoscaling: bool = False,
    faults: Faults = NONE,
    duration: float | None = None,
) -> SimResult:
    duration = duration or case.duration
    sim = ServiceSim(
        case.spec(setting, tuning=tuning, autoscaling=autoscaling),
        calibration=case.calibration,
        replicas=2 if autoscaling else 1,
        noise=scenario.noise,
        faults=faults,
    )
    return sim.run(scenario.workload(case, duration), duration, seed)


def ratio(a: float, b: float) -> float | None:
    """a / b; None where b served nothing within the SLO (and a did)."""
    if b > 0:
        return a / b
    return 1.0 if a == 0 else None


def one_seed(case: Case, scenario: Scenario, seed: int, quiet: float) -> dict:
    fixed = {s.label: simulate(case, scenario, s, seed).goodput() for s in case.grid()}
    best = max(fixed, key=fixed.__getitem__)
    long = CONVERGED_SECONDS + quiet if scenario.long else None
    loop = simulate(case, scenario, case.start, seed, tuning=True, duration=long)
    goodput = loop.goodput(until=case.duration)
    return {
        "seed": seed,
        "fixed": {k: round(v, 2) for k, v in fixed.items()},
        "best_fixed": best,
        "loop_goodput": round(goodput, 2),
        "loop_throughput": round(loop.throughput(until=case.duration), 2),
        "loop_over_best": ratio(goodput, fixed[best]),
        "loop_over_start": ratio(goodput, fixed[case.start.label]),
        "decisions_per_hour": len(loop.decisions()) / (loop.duration / HOUR),
        "kept": loop.verdicts("Kept"),
        "reversals": loop.verdicts("Reverted"),
        "events": dict(loop.reasons()),
        "final_setting": loop.trace[-1].max_num_seqs if loop.trace else None,
        "decisions_after_convergence": len(loop.decisions(CONVERGED_SECONDS)) if long else None,
        "faults": fault_check(case, scenario, seed),
    }


def fault_check(case: Case, scenario: Scenario, seed: int) -> dict:
    """Twice the load on two replicas, autoscaling and tuning on, with and without faults."""
    doubled = dataclasses.replace(
        case, rate=2 * case.rate, heavy_prefill_rate=2 * case.heavy_prefill_rate
    )
    runs = {
        name: simulate(
            doubled, scenario, case.start, seed, tuning=True, autoscaling=True, faults=faults
        )
        for name, faults in (("faults", ALL), ("clean", NONE))
    }
    f, c = runs["faults"], runs["clean"]
    return {
        "scale_downs_with_faults": f.reasons()["ScaledDown"],
        "scale_downs_without": c.reasons()["ScaledDown"],
        "scale_downs_on_failed_scrapes": f.scale_downs_on_failed_scrapes,
        "scale_ups_with_faults": f.reasons()["ScaledUp"],
        "scale_ups_without": c.reasons()["ScaledUp"],
        "apply_failed_events": f.reasons()["AdminApplyFailed"],
        "loop_blind_events": f.reasons()["LoopBlind"],
        "goodput_with_faults_over_without": ratio(f.goodput(), c.goodput()),
    }


def summarize(seeds: list[dict], long: bool) -> dict:
    def stats(key: str) -> dict:
        values = [s[key] for s in seeds if s[key] is not None]
        undefined = len(seeds) - len(values)
        if not values:
            return {"median": None, "worst": None, "undefined": undefined}
        return {"median": statistics.median(values), "worst": min(values), "undefined": undefined}

    faults = [s["faults"] for s in seeds]
    out = {
        "loop_over_best": stats("loop_over_best"),
        "loop_over_start": stats("loop_over_start"),
        "decisions_per_hour": statistics.mean(s["decisions_per_hour"] for s in seeds),
        "reversals": sum(s["reversals"] for s in seeds),
        "kept": sum(s["kept"] for s in seeds),
        "fault_scale_downs": sum(f["scale_downs_with_faults"] for f in faults),
        "clean_scale_downs": sum(f["scale_downs_without"] for f in faults),
        "scale_downs_on_failed_scrapes": sum(f["scale_downs_on_failed_scrapes"] for f in faults),
    }
    if long:
        out["decisions_after_convergence_max"] = max(
            s["decisions_after_convergence"] for s in seeds
        )
    return out


def evaluate(seeds: int, quick: bool, calibrations: list[str]) -> dict:
    quiet = QUIET_SECONDS / 4 if quick else QUIET_SECONDS
    cases = {}
    for name in calibrations:
        case = CASES[name]
        if quick:
            case = dataclasses.replace(case, duration=case.duration / 3)
        cases[name] = {}
        for scenario in SCENARIOS:
            started = time.perf_counter()
            runs = [one_seed(case, scenario, seed, quiet) for seed in range(seeds)]
            cases[name][scenario.name] = {
                "summary": summarize(runs, scenario.long),
                "seeds": runs,
                "wall_seconds": round(time.perf_counter() - started, 1),
                "start": case.start.label,
                "duration_seconds": case.duration,
            }
            print(f"{name} {scenario.name}: {cases[name][scenario.name]['wall_seconds']} s",
                  flush=True)  # fmt: skip
    return {"cases": cases, "quiet_seconds": quiet, "seeds": seeds, "quick": quick}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--quick", action="store_true",
                   help="2 seeds, a third of each run, a 30 min quiet tail")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="draw the summary plot here")
    p.add_argument("--calibration", action="append", choices=list(CASES),
                   help="only this calibration (repeatable; default: all)")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    seeds = 2 if args.quick else args.seeds
    started = time.perf_counter()
    results = evaluate(seeds, args.quick, args.calibration or list(CASES))
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    # On a shared machine the wall time measures the neighbours too.
    results["cpu_seconds"] = round(time.process_time(), 1)
    results["machine"] = report.machine()
    print(report.table(results))
    print(
        f"\n{results['wall_seconds']} s wall, {results['cpu_seconds']} s CPU on "
        f"{results['machine']['model']}"
    )
    if args.out:
        report.write_json(results, args.out)
    if args.plot:
        report.plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
