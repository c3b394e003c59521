"""The closed loop against the best fixed max_num_seqs on real `batchpilot serve` servers,
paired per repeat in a randomised ABBA order (the loop v3 issue's "Real servers" check).

    .venv/bin/python benchmarks/tune.py --load closed --clients 48          # the full run
    .venv/bin/python benchmarks/tune.py --load poisson --rate 6 ...

1. Servers: --servers (≥ 2) processes of the bundled model, started once, each pinned to
   its own CPU set (--server-cpus), with the limits and CRD defaults the operator ships
   (TuneLimits(), spec.tuning and spec.slo defaults, its 15 s loop period and 60 s metrics
   window), and warmed up identically.
2. Calibration: the pre-registered fixed values (--values, plus --start) run side by side,
   --servers at a time, in windows shaped like the repeats'; F is the best median goodput
   (or --fixed, then only F and the start are measured).
3. Repeats: T (the real ClosedLoop from --start, a fresh tuner each repeat) and F, and with
   three servers S (the start, fixed), each on its own server in the SAME window, under
   identical copies of the load (same seed and arrival times). Which server runs which arm
   follows a seeded random ABBA schedule (abba.schedule). Each arm is scored per request
   (TTFT and mean TPOT against spec.slo, as `vllm bench serve --goodput` judges it) over
   the window after a shared --warmup, and over its second half.
4. Optional: a soak (--soak-seconds, 7200 in the issue) and an episodic CPU hog beside
   every server (--hog-seconds, --hog-period), each a T + F window.

Writes benchmarks/results/tune-abba-<date>[-<tag>].json: args, machine, the ABBA order,
every window, and the summary with each pass criterion evaluated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.guardrails import TuneLimits
from batchpilot.server.bench.server_process import free_port, running_server
from benchmarks.realtune import abba, report, window
from benchmarks.realtune.load import ClosedLoad, PoissonLoad, poisson_arrivals
from benchmarks.realtune.machine import (
    affinity,
    bench_cpus,
    load_average,
    lscpu,
    parse_cpu_sets,
    split_cpus,
)
from benchmarks.realtune.window import TOKEN, Plan, Server, log

# The bundled SmolLM2-135M's KV per token in bfloat16: 30 layers x 3 KV heads x 64 dims x
# (K, V) x 2 bytes. --kv-constrained sizes the cache in these units.
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2


def kv_constrained_memory(sequences: int, tokens: int) -> str:
    """A KV cache that holds ``sequences`` sequences of ``tokens`` each: past that many
    running sequences the engine preempts, so the best max_num_seqs lies inside the tuning
    range instead of at its top."""
    return f"{max(1, sequences * tokens * KV_BYTES_PER_TOKEN >> 20)}MiB"


def tuning_spec(start: int, args):
    spec: dict = {
        "engine": {"maxNumSeqs": start},
        "tuning": {"enabled": True},
    }
    if args.tuning_range:
        lo, hi = args.tuning_range
        spec["tuning"]["maxNumSeqs"] = {"min": lo, "max": hi}
    slo = {k: v for k, v in (("timeToFirstTokenSeconds", args.ttft_target),
                             ("interTokenLatencySeconds", args.itl_target)) if v}  # fmt: skip
    if slo:
        spec["slo"] = slo
    return parse_spec(spec)


def make_load(args, seed: int, measure: float, url: str, t0: float):
    """One copy of the load; every server of a window gets one with the same ``seed``."""
    if args.load == "closed":
        return ClosedLoad(url, args.clients, args.output_lens, args.prompt_repeats, seed)
    horizon = args.warmup + measure + 60  # arrivals outlast the window
    arrivals = poisson_arrivals(args.rate, horizon, seed)
    return PoissonLoad(url, arrivals, args.output_lens, args.prompt_repeats, seed)


def plan(args, seed: int, measure: float, hog_period: float | None = None) -> Plan:
    spec = tuning_spec(args.start, args)
    return Plan(
        warmup=args.warmup, measure=measure, load=partial(make_load, args, seed, measure),
        spec=partial(tuning_spec, args=args), ttft_target=spec.slo.time_to_first_token_seconds,
        itl_target=spec.itl_target_seconds, hog_period=hog_period,
    )  # fmt: skip


async def measured(servers, arms, fixed, p: Plan, start: int) -> dict:
    lavg = load_average()
    w = await window.run(servers[: len(arms)], arms, start, fixed, p)
    w["load_average"] = [lavg, load_average()]
    for a in w["arms"]:
        log(f"  server {a['server']} arm {a['arm']}: goodput {a['goodput_whole']:.1f} "
            f"(second half {a['goodput_second_half']:.1f}), throughput "
            f"{a['throughput_whole']:.1f} tok/s, {a['requests_meeting_slo']} met the SLO")  # fmt: skip
    return w


async def calibrate(servers, args, rng: random.Random) -> list[dict]:
    values = [args.fixed] if args.fixed else list(args.values)
    values += [args.start] if args.start not in values else []
    windows = []
    for c in range(args.calibration_rounds):
        order = rng.sample(values, len(values))  # which value meets which server, and when
        for i in range(0, len(order), len(servers)):
            arms = [str(v) for v in order[i : i + len(servers)]]
            log(f"calibration {c}: {arms} on servers 0..{len(arms) - 1}")
            p = plan(args, args.seed + 1000 * (c + 1) + i, args.window_seconds)
            windows.append(await measured(servers, arms, {a: int(a) for a in arms}, p, args.start))
    return windows


async def warm(servers, args) -> None:
    """The same closed load on every server at the start value, then idle: the first
    requests' one-time costs (kernels, caches) are paid before any arm."""
    log(f"warming every server for {args.server_warmup:.0f} s")
    p = Plan(warmup=0.0, measure=args.server_warmup,
             load=lambda url, t0: ClosedLoad(url, args.clients, args.output_lens,
                                             args.prompt_repeats, args.seed - 1),
             spec=partial(tuning_spec, args=args), ttft_target=1.0, itl_target=1.0)  # fmt: skip
    # No arm is tuned and the window's scores are dropped: the targets above are unused.
    label = str(args.start)
    await window.run(servers, [label] * len(servers), args.start, {label: args.start}, p)


async def experiment(servers, args) -> dict:
    rng = random.Random(args.seed)
    await warm(servers, args)
    cal = await calibrate(servers, args, rng)
    table = report.calibration(cal)
    best = args.fixed or report.best_fixed(table)
    arms = ["T", "F"]
    if len(servers) >= 3 and args.start != best:
        arms.append("S")
    fixed = {"F": best, "S": args.start}
    order = abba.schedule(arms, args.repeats, args.seed)
    log(f"F = max_num_seqs {best}; ABBA order (arm per server): {order}")
    repeats = []
    for r, assignment in enumerate(order):
        log(f"repeat {r}: {assignment}")
        p = plan(args, args.seed + r, args.window_seconds)
        repeats.append(await measured(servers, assignment, fixed, p, args.start))
    extra = {}
    if args.soak_seconds:
        log(f"soak: {args.soak_seconds:.0f} s")
        p = plan(args, args.seed + 500, args.soak_seconds)
        extra["soak"] = await measured(servers, ["T", "F"], fixed, p, args.start)
    if args.hog_seconds:
        log(f"hog beside every server, {args.hog_period:.0f} s on/off, {args.hog_seconds:.0f} s")
        p = plan(args, args.seed + 600, args.hog_seconds, args.hog_period)
        extra["hog"] = await measured(servers, ["T", "F"], fixed, p, args.start)
    start_arm = "S" if "S" in arms else ("F" if best == args.start else None)
    summary = report.summary(
        repeats, start_arm, table.get(str(args.start), {}).get("median"), extra.get("soak"),
        extra.get("hog"), args.seed,
    )  # fmt: skip
    return {"calibration": {"table": table, "best_fixed": best, "windows": cal},
            "abba_order": order, "repeats": repeats, **extra, "summary": summary}  # fmt: skip


def serve_args(args, admin_port: int) -> list[str]:
    out = ["--max-model-len", str(args.max_model_len), "--admin-token", TOKEN,
           "--admin-port", str(admin_port), "--max-num-seqs", str(args.start)]  # fmt: skip
    kv = args.kv_cache_memory or (
        kv_constrained_memory(args.kv_sequences, args.kv_tokens) if args.kv_constrained else None
    )
    return out + (["--kv-cache-memory", kv] if kv else [])


async def main_async(args, tmp: Path, cpu_sets: list[set[int]]) -> dict:
    with contextlib.ExitStack() as stack:
        servers = []
        for i, cpus in enumerate(cpu_sets):
            admin_port = free_port()
            with affinity(cpus):  # the engine sizes its torch threads to its affinity
                url = stack.enter_context(
                    running_server(serve_args(args, admin_port), tmp / f"serve-{i}.log")
                )
            servers.append(Server(url, f"http://127.0.0.1:{admin_port}", frozenset(cpus)))
        return await experiment(servers, args)


def parse_args(argv=None):
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--servers", type=int, default=2, help="≥ 2; a third runs the start arm")
    p.add_argument("--server-cpus", type=parse_cpu_sets, default=None,
                   help="one CPU set per server, e.g. 0,1 or 0-1,2-3 (default: the CPUs "
                   "dealt evenly); the load generator and the loop get the rest, or share")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=512, help="the model length")
    p.add_argument("--load", choices=("closed", "poisson"), default="closed")
    p.add_argument("--clients", type=int, default=48, help="closed loop: clients")
    p.add_argument("--rate", type=float, default=None, help="poisson: requests per second")
    p.add_argument("--output-lens", type=ints, default=[64, 128])
    p.add_argument("--prompt-repeats", type=ints, default=[1, 5, 20],
                   help="prompt lengths: the seed prompt repeated this many times")  # fmt: skip
    p.add_argument("--kv-constrained", action="store_true",
                   help="a KV cache of --kv-sequences sequences of --kv-tokens (bf16 model)")  # fmt: skip
    p.add_argument("--kv-sequences", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=128,
                   help="tokens a sequence holds on average (the default workload: a 76-token "
                   "mean prompt plus half its 96-token mean output)")  # fmt: skip
    p.add_argument("--kv-cache-memory", default=None, help="the servers' KV size, e.g. 64MiB")
    p.add_argument("--values", type=ints, default=[8, 16, 32, 48],
                   help="the pre-registered fixed max_num_seqs list F is chosen from")  # fmt: skip
    p.add_argument("--fixed", type=int, default=None, help="F, instead of calibrating")
    p.add_argument("--start", type=int, default=8, help="the tuned arm's start value")
    p.add_argument("--tuning-range", type=ints, default=None,
                   help="min,max of spec.tuning.maxNumSeqs (default: the CRD's, 8..256)")  # fmt: skip
    p.add_argument("--ttft-target", type=float, default=None, help="default: the CRD's (2 s)")
    p.add_argument("--itl-target", type=float, default=None,
                   help="mean TPOT target (default: the CRD's, 0.1 s)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calibration-rounds", type=int, default=1)
    p.add_argument("--server-warmup", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=60.0, help="shared warm-up of a window, s")
    p.add_argument("--window-seconds", type=float, default=1800.0, help="scored span, s")
    p.add_argument("--soak-seconds", type=float, default=0.0, help="the issue: 7200")
    p.add_argument("--hog-seconds", type=float, default=0.0)
    p.add_argument("--hog-period", type=float, default=300.0, help="hog off, then on, each s")
    p.add_argument("--seed", type=int, default=20261204, help="ABBA order and loads")
    p.add_argument("--tag", default="", help="a suffix of the result's name, e.g. smoke")
    p.add_argument("--result-dir", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.servers < 2:
        p.error("--servers must be at least 2: the arms of a repeat run side by side")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.load == "poisson" and not args.rate:
        p.error("--load poisson needs --rate")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cpus = os.sched_getaffinity(0)
    cpu_sets = args.server_cpus or split_cpus(args.servers, cpus)
    if len(cpu_sets) != args.servers:
        raise SystemExit(f"--server-cpus gives {len(cpu_sets)} sets for {args.servers} servers")
    bench = bench_cpus(cpu_sets, cpus)
    shared = bool(bench & set().union(*cpu_sets))
    os.sched_setaffinity(0, bench)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tune-"))  # server logs
    started, lavg0 = time.time(), load_average()
    pinning = (f"servers on CPUs {[sorted(c) for c in cpu_sets]}, load generator and loop on "
               f"{sorted(bench)}" + (" (shared with the servers: no spare CPU)" if shared else ""))  # fmt: skip
    log(f"{pinning}; load average {lavg0}; logs in {tmp}")
    results = asyncio.run(main_async(args, tmp, cpu_sets))
    spec = tuning_spec(args.start, args)
    out = {
        "date": time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
        "wall_seconds": round(time.time() - started),
        "machine": {"lscpu": lscpu(), "pinning": pinning, "load_average_start": lavg0,
                    "load_average_end": load_average()},
        "slo": {"ttft_seconds": spec.slo.time_to_first_token_seconds,
                "tpot_seconds": spec.itl_target_seconds},
        "limits": asdict(TuneLimits()), "loop_interval_s": window.LOOP_INTERVAL,
        "tuning": spec.tuning.model_dump(by_alias=True),
        "args": {k: [sorted(c) for c in v] if k == "server_cpus" and v else
                 (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **results,
    }  # fmt: skip
    print(json.dumps(out["summary"]["criteria"], indent=2))
    suffix = f"-{args.tag}" if args.tag else ""
    path = args.result_dir / f"tune-abba-{out['date'][:8]}{suffix}.json"
    path.write_text(json.dumps(out, indent=2))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
