"""The online tuner against the best fixed max_num_seqs, on one real `batchpilot serve`.

    .venv/bin/python benchmarks/tune.py [--values 2,4,8,16,24,32] [--start 2] ...

1. Sweep: one server; for each value, PATCH max_num_seqs through /admin/config, run the
   fixed load (`batchpilot bench serve`: --concurrency closed-loop clients, EOS ignored),
   drop --warmup seconds, then measure generation tokens/s and ITL P99 for --measure
   seconds from the server's /metrics: the counters and histograms the operator reads.
2. Tuned: back to the poor --start value, the same load for --tuned-seconds while the real
   loop (operator/loop.py: observe → decide_tuning → admin apply, --cooldown) drives it.
   Throughput is measured after its last decision (converged) and over the whole run.
3. Thrash: a second server whose KV cache holds a few sequences, started with an oversized
   max_num_seqs under load, the loop driving it: preemptions per minute before the first
   decision and after the last one.

Writes benchmarks/results/tune-<date>.json and benchmarks/results/tune-<date>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from batchpilot import names
from batchpilot.operator.admin_client import AdminClient
from batchpilot.operator.crd import parse_spec
from batchpilot.operator.loop import ClosedLoop
from batchpilot.operator.observe import Observer, UrlMetricsSource, Window, parse_metrics
from batchpilot.operator.tune import EngineSettings, TuneLimits
from batchpilot.server.bench.server_process import running_server

TOKEN = "bench-tune-token"
KEY = "bench/tune"
SCRAPE_PERIOD = 5.0
BATCHPILOT = str(Path(sys.executable).with_name("batchpilot"))


@dataclass
class Measured:
    max_num_seqs: int
    tokens_per_second: float
    itl_p99: float | None
    preemptions_per_minute: float
    seconds: float

    @classmethod
    def of(cls, w: Window, max_num_seqs: int) -> Measured:
        return cls(max_num_seqs, w.generation_tokens_per_second, w.itl_p99,
                   w.preemptions_per_minute, w.span_seconds)  # fmt: skip


@dataclass
class TunedRun:
    start: int
    decisions: list[dict] = field(default_factory=list)  # time (s from start), kind, value, reason
    timeline: list[dict] = field(default_factory=list)  # time, max_num_seqs, tokens/s
    converged: Measured | None = None
    whole_run: Measured | None = None
    first_window: Measured | None = None  # before the first decision


class Tee:
    """The loop's metrics source, also recording into a long measuring window."""

    def __init__(self, url: str, measuring: Observer):
        self.source = UrlMetricsSource([url], timeout=15)
        self.measuring = measuring

    async def scrape(self, namespace, name):
        scrapes = await self.source.scrape(namespace, name)
        self.measuring.record(KEY, scrapes, time.time())
        return scrapes


# --------------------------------------------------------------------------- load and I/O


def start_load(url: str, args, result_dir: Path, output_lens: str) -> subprocess.Popen:
    """`batchpilot bench serve` in the background, returned once its requests are running."""
    with open(result_dir / "load.log", "ab") as log:
        load = subprocess.Popen(
            [BATCHPILOT, "bench", "serve", "--url", url, "--request-rate", "inf",
             "--max-concurrency", str(args.concurrency), "--num-prompts", "3000",
             "--output-lens", output_lens, "--prompt-repeats", args.prompt_repeats,
             "--num-warmups", "0", "--result-dir", str(result_dir)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 300
    while gauge(url, names.NUM_REQUESTS_RUNNING) == 0:
        if load.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the load did not start; see {result_dir / 'load.log'}")
        time.sleep(0.5)
    return load


def gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=15).text
    return parse_metrics(text, time.time()).gauges.get(name, 0.0)


def stop_load(load: subprocess.Popen, url: str) -> None:
    load.kill()
    load.wait()
    wait_idle(url)


def wait_idle(url: str, timeout: float = 300.0) -> None:
    """Until the aborted requests have left the engine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = (names.NUM_REQUESTS_RUNNING, names.NUM_REQUESTS_WAITING, names.NUM_REQUESTS_SWAPPED)
        if not any(gauge(url, name) for name in busy):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{url} still busy after {timeout} s")


def set_max_num_seqs(url: str, value: int) -> None:
    failures = asyncio.run(AdminClient(timeout=60).set_max_num_seqs([url], TOKEN, value))
    if failures[url]:
        raise RuntimeError(failures[url])


async def observe_for(url: str, seconds: float) -> Window:
    observer, source = Observer(window_seconds=seconds + 60), UrlMetricsSource([url], timeout=15)
    end = time.monotonic() + seconds
    while True:
        observer.record(KEY, await source.scrape("", ""), time.time())
        if time.monotonic() >= end:
            return observer.window(KEY)
        await asyncio.sleep(min(SCRAPE_PERIOD, max(0.0, end - time.monotonic())))


# --------------------------------------------------------------------------- the phases


def sweep(url: str, args, tmp: Path) -> list[Measured]:
    points = []
    for value in args.values:
        set_max_num_seqs(url, value)
        load = start_load(url, args, tmp, args.output_lens)
        try:
            asyncio.run(observe_for(url, args.warmup))
            point = Measured.of(asyncio.run(observe_for(url, args.measure)), value)
        finally:
            stop_load(load, url)
        print(f"fixed max_num_seqs={value}: {point.tokens_per_second:.1f} tok/s, "
              f"ITL P99 {point.itl_p99}", flush=True)  # fmt: skip
        points.append(point)
    return points


def tuning_spec(start: int, args, lo: int, hi: int, itl_target: float):
    return parse_spec(
        {"engine": {"maxNumSeqs": start},
         "tuning": {"enabled": True, "cooldownSeconds": args.cooldown,
                    "targetInterTokenLatencySeconds": itl_target,
                    "maxNumSeqs": {"min": lo, "max": hi}}}
    )  # fmt: skip


async def tuned_run(url: str, spec, start: int, seconds: float, args) -> TunedRun:
    measuring = Observer(window_seconds=seconds + 120)
    loop = ClosedLoop(
        Tee(url, measuring), AdminClient(timeout=60),
        observer=Observer(window_seconds=args.window),
        limits=TuneLimits(min_window_seconds=args.min_window),
    )  # fmt: skip
    run, status, settings = TunedRun(start), {}, EngineSettings(start)
    t0 = time.time()
    while time.time() - t0 < seconds:
        outcome = await loop.run_once("bench", "tune", spec, status, 1, settings, TOKEN)
        status.update(outcome.status_patch)
        tuned = status["tuning"]
        settings = EngineSettings(
            tuned[names.MAX_NUM_SEQS.crd_field], tuned[names.KV_CACHE_DTYPE.crd_field]
        )
        now = time.time() - t0
        if outcome.tuning.changes:
            if not run.decisions:
                run.first_window = Measured.of(measuring.window(KEY), start)
            run.decisions.append({"time": round(now, 1), "kind": outcome.tuning.kind,
                                  "max_num_seqs": outcome.tuning.max_num_seqs,
                                  "reason": outcome.tuning.reason})  # fmt: skip
        tps = (status.get("metrics") or {}).get("generationTokensPerSecond")
        run.timeline.append({"time": round(now, 1), "max_num_seqs": settings.max_num_seqs,
                             "tokens_per_second": tps})  # fmt: skip
        await asyncio.sleep(SCRAPE_PERIOD)
    last = t0 + (run.decisions[-1]["time"] if run.decisions else 0.0)
    converged = measuring.window(KEY, since=last + args.warmup)
    if converged is not None and converged.span_seconds > 0:
        run.converged = Measured.of(converged, settings.max_num_seqs)
    run.whole_run = Measured.of(measuring.window(KEY), settings.max_num_seqs)
    return run


def tuned(url: str, args, tmp: Path) -> TunedRun:
    set_max_num_seqs(url, args.start)
    load = start_load(url, args, tmp, args.output_lens)
    try:
        spec = tuning_spec(args.start, args, min(args.values), max(args.values), args.itl_target)
        return asyncio.run(tuned_run(url, spec, args.start, args.tuned_seconds, args))
    finally:
        stop_load(load, url)


@contextlib.contextmanager
def server(serve_args: list[str], log: Path, cpus: set[int] | None):
    """running_server, started on ``cpus`` only: the engine sizes its torch threads to its
    affinity, and on a shared machine one thread that owns a core beats two that wait for
    each other in every parallel region. The load generator keeps every CPU."""
    with contextlib.ExitStack() as stack:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus or before)
        try:
            url = stack.enter_context(running_server(serve_args, log))
        finally:
            os.sched_setaffinity(0, before)
        yield url


def thrash(args, tmp: Path) -> TunedRun:
    # 13 MiB of float32 KV: 18 blocks of 16 tokens, two sequences at 12 + 96 tokens.
    serve = ["--max-num-seqs", "16", "--kv-cache-memory", "13MiB", "--swap-space", "0.02",
             "--dtype", "float32", "--max-model-len", "256", "--admin-token", TOKEN]  # fmt: skip
    with server(serve, tmp / "thrash-serve.log", args.server_cpus) as url:
        load = start_load(url, argparse.Namespace(**{**vars(args), "concurrency": 16}), tmp, "96")
        try:
            # Memory is the question here, not latency: a target no step misses.
            spec = tuning_spec(16, args, 1, 16, itl_target=60.0)
            return asyncio.run(tuned_run(url, spec, 16, args.thrash_seconds, args))
        finally:
            stop_load(load, url)


# --------------------------------------------------------------------------- report


def summarize(points: list[Measured], run: TunedRun, thrash_run: TunedRun, args) -> dict:
    feasible = [p for p in points if p.itl_p99 is not None and p.itl_p99 <= args.itl_target]
    best = max(feasible, key=lambda p: p.tokens_per_second, default=None)

    def fraction(m: Measured | None) -> float | None:
        return round(m.tokens_per_second / best.tokens_per_second, 3) if m and best else None

    bound = TuneLimits().thrash_per_minute
    after = thrash_run.converged
    return {
        "best_fixed": asdict(best) if best else None,
        "tuned_fraction_of_best_converged": fraction(run.converged),
        "tuned_fraction_of_best_whole_run": fraction(run.whole_run),
        "decisions_to_converge": len(run.decisions),
        "thrash_decisions": len(thrash_run.decisions),
        "thrash_recovered": bool(after and after.preemptions_per_minute <= bound),
        "thrash_preemptions_per_minute_before": thrash_run.first_window
        and round(thrash_run.first_window.preemptions_per_minute, 1),
        "thrash_preemptions_per_minute_after": after and round(after.preemptions_per_minute, 1),
    }


def plot(points: list[Measured], run: TunedRun, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [p.max_num_seqs for p in points]
    left.plot(xs, [p.tokens_per_second for p in points], "o-", label="fixed: tokens/s")
    if run.converged:
        left.axhline(run.converged.tokens_per_second, color="C2", ls="--",
                     label=f"tuned from {run.start}, after convergence")  # fmt: skip
    left.set_xlabel("max_num_seqs")
    left.set_ylabel("generation tokens/s")
    left.set_xscale("log", base=2)
    itl = left.twinx()
    itl.plot(xs, [p.itl_p99 or 0 for p in points], "s:", color="C3", label="fixed: ITL P99")
    itl.axhline(args.itl_target, color="C3", lw=0.8, label="ITL target")
    itl.set_ylabel("ITL P99 (s)")
    left.legend(loc="upper left", fontsize=8)
    itl.legend(loc="lower right", fontsize=8)
    left.set_title("fixed max_num_seqs sweep against the tuner")
    ts = [p["time"] for p in run.timeline]
    right.step(ts, [p["max_num_seqs"] for p in run.timeline], where="post", label="max_num_seqs")
    right.set_xlabel("seconds")
    right.set_ylabel("max_num_seqs")
    rate = right.twinx()
    rate.plot(ts, [p["tokens_per_second"] or 0 for p in run.timeline], color="C1", alpha=0.7,
              label="tokens/s (loop window)")  # fmt: skip
    rate.set_ylabel("generation tokens/s")
    right.legend(loc="upper left", fontsize=8)
    rate.legend(loc="lower right", fontsize=8)
    right.set_title("the tuned run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def simulate(path: Path) -> None:
    """The docs' scenario (docs/tuning.md): one replica whose KV cache holds ten long
    sequences, max_num_seqs 48, fp8 allowed, autoscaling on; quiet, then 4x the load for an
    hour, then back down. The real loop every 15 s, 2.5 hours of simulated time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from batchpilot.operator import sim

    spec = parse_spec(
        {"engine": {"maxNumSeqs": 48},
         "autoscaling": {"enabled": True, "maxReplicas": 6},
         "tuning": {"enabled": True, "allowFP8KVCache": True,
                    "maxNumSeqs": {"min": 4, "max": 64}, "targetInterTokenLatencySeconds": 0.5}}
    )  # fmt: skip
    load = sim.Workload(lambda t: 0.6 if t < 2400 else (2.4 if t < 6000 else 1.0), 2.4)
    result = sim.ServiceSim(spec, sim.ReplicaConfig(kv_cache_bytes=240 * 368_640)).run(load, 9000)
    tr = result.trace
    minutes = [p.time / 60 for p in tr]
    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    axes[0].plot(minutes, [p.offered_per_second for p in tr], label="offered requests/s")
    queue = axes[0].twinx()
    queue.plot(minutes, [p.waiting for p in tr], color="C3", lw=0.8, label="queue (waiting)")
    axes[0].legend(loc="upper left", fontsize=8)
    queue.legend(loc="upper right", fontsize=8)
    axes[1].step(minutes, [p.desired_replicas for p in tr], where="post", label="desired")
    axes[1].step(minutes, [p.ready_replicas for p in tr], where="post", ls="--", label="Ready")
    axes[1].set_ylabel("replicas")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].step(minutes, [p.max_num_seqs for p in tr], where="post", color="C2")
    axes[2].set_ylabel("max_num_seqs")
    axes[3].step(minutes, [1 if p.kv_cache_dtype.startswith("fp8") else 0 for p in tr],
                 where="post", color="C4", label="KV fp8 (1) / auto (0)")  # fmt: skip
    rate = axes[3].twinx()
    per_min = [0] + [
        (b.preemptions - a.preemptions) * 60 / (b.time - a.time) for a, b in itertools.pairwise(tr)
    ]
    rate.plot(minutes, per_min, color="C3", lw=0.8, label="preemptions/min")
    axes[3].legend(loc="upper left", fontsize=8)
    rate.legend(loc="upper right", fontsize=8)
    axes[3].set_xlabel("simulated minutes")
    for t, _, _ in result.events:
        for ax in axes:
            ax.axvline(t / 60, color="grey", lw=0.4, alpha=0.5)
    axes[0].set_title(
        "operator/sim.py: the closed loop on a memory-tight replica under a load step"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    for t, reason, message in result.events:
        print(f"{t / 60:6.1f} min  {reason}: {message}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--values", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4, 8, 16, 24, 32]
    )
    p.add_argument("--start", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--output-lens", default="64,128")
    p.add_argument("--prompt-repeats", default="1,5,20")
    p.add_argument("--itl-target", type=float, default=None,
                   help="seconds, ITL P99 (default: the sweep's median ITL P99, so that the "
                   "target binds: about half the swept values meet it)")  # fmt: skip
    p.add_argument("--cooldown", type=int, default=30)
    p.add_argument("--window", type=float, default=60.0, help="the loop's metrics window, s")
    p.add_argument("--min-window", type=float, default=30.0,
                   help="least observation after a change before the tuner judges it, s")  # fmt: skip
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--measure", type=float, default=40.0)
    p.add_argument("--tuned-seconds", type=float, default=180.0)
    p.add_argument("--thrash-seconds", type=float, default=150.0)
    p.add_argument("--result-dir", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--server-cpus", type=lambda s: {int(c) for c in s.split(",")}, default=None,
                   help="CPUs to pin the server to, e.g. 1 (default: all)")  # fmt: skip
    p.add_argument("--simulate", type=Path, metavar="PNG",
                   help="only draw the simulator scenario of docs/tuning.md into PNG")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.simulate:
        simulate(args.simulate)
        return 0
    date = time.strftime("%Y%m%d-%H%M%S")
    tmp = Path(tempfile.mkdtemp(prefix="bench-tune-"))  # server logs and load results
    serve = ["--max-model-len", "512", "--admin-token", TOKEN, "--max-num-seqs", str(args.start)]
    with server(serve, tmp / "serve.log", args.server_cpus) as url:
        points = sweep(url, args, tmp)
        if args.itl_target is None:
            itls = sorted(p.itl_p99 for p in points if p.itl_p99 is not None)
            args.itl_target = math.ceil(itls[(len(itls) - 1) // 2] * 1000) / 1000  # whole ms, up
            print(f"ITL P99 target: {args.itl_target} s (the sweep's median)", flush=True)
        run = tuned(url, args, tmp)
    thrash_run = thrash(args, tmp)
    summary = summarize(points, run, thrash_run, args)
    print(json.dumps(summary, indent=2))
    out = {"date": date, "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
           "sweep": [asdict(p) for p in points], "tuned": asdict(run), "thrash": asdict(thrash_run)}  # fmt: skip
    (args.result_dir / f"tune-{date}.json").write_text(json.dumps(out, indent=2))
    plot(points, run, args, args.result_dir / f"tune-{date}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
