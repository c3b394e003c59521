"""The verified tuner against fixed max_num_seqs values, on real `batchpilot serve` servers.

    .venv/bin/python benchmarks/tune.py [--quick] [--values 8,16,32,48] [--repeats 3] ...

The service's latency targets (spec.slo: --ttft-target, --itl-target) are fixed before
anything runs. The server is pinned to --server-cpus (default: the last CPU) and this
process, which runs the load and the loop, to the others. Goodput is tokens/s of requests
that met both targets, measured two ways: per request from the load's own timings (TTFT,
and mean time per output token against the ITL target, as `vllm bench serve --goodput`
judges a request), and the way the loop sees it (experiment.score on the server's /metrics
histograms).

1. Arms, interleaved: for r in 1..--repeats: each fixed value (set through /admin/config),
   then T, the tuned run (the real ClosedLoop from --start for --tuned-seconds, a fresh
   tuner each time). A fixed arm drops --warmup s and measures --measure s; T is scored
   over its last --measure s (and over the whole run after --warmup).
2. Thrash: a server whose KV cache holds two sequences, started at max_num_seqs 16 under
   load; the loop drives it; goodput (and throughput, preemptions) before its first
   decision and after its last verdict.
3. Noisy neighbour: the main server from the best fixed value, the loop driving it, and a
   CPU hog on the server's core switched on and off; max_num_seqs over time and verdicts.

Writes benchmarks/results/tune-<date>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchpilot import names
from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.admin_client import AdminClient
from batchpilot.operator.loop.guardrails import TuneLimits
from batchpilot.operator.loop.observe import Observer, Window, parse_metrics
from batchpilot.operator.loop.scrape import UrlMetricsSource, on_port
from batchpilot.operator.loop.state import settings_from_status
from batchpilot.operator.loop.tuner_state import EngineSettings
from batchpilot.operator.loop.turn import ClosedLoop
from batchpilot.operator.loop.verify import Targets, score
from batchpilot.server.bench.server_process import running_server
from benchmarks.realtune import report
from benchmarks.realtune.load import ClosedLoad
from benchmarks.realtune.machine import Hog, affinity, load_average, lscpu, split_cpus

TOKEN = "bench-tune-token"
KEY = "bench/tune"
PERIOD = 5.0  # the loop's turn and the scrape period, s


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


# --------------------------------------------------------------------------- server I/O


async def set_max_num_seqs(url: str, value: int) -> None:
    admin = on_port(url, names.DEFAULT_ADMIN_PORT)
    failures = await AdminClient(timeout=60).set_live(
        [admin], TOKEN, {names.MAX_NUM_SEQS.name: value}
    )
    if failures[admin]:
        raise RuntimeError(failures[admin])


async def wait_idle(url: str, timeout: float = 300.0) -> None:
    """Until the requests the stopped load left behind have left the engine."""
    busy = (names.NUM_REQUESTS_RUNNING, names.NUM_REQUESTS_WAITING, names.NUM_REQUESTS_SWAPPED)
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() < deadline:
            gauges = parse_metrics((await client.get(f"{url}/metrics")).text, time.time()).gauges
            if not any(gauges.get(n, 0.0) for n in busy):
                return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} still busy after {timeout} s")


class Recording:
    """Every scrape round, so that a window can be cut from any span of a run."""

    def __init__(self):
        self.rounds: list[tuple[float, list]] = []

    def record(self, key: str, scrapes, now: float) -> None:
        self.rounds.append((now, list(scrapes)))

    def window(self, key: str, since: float, until: float = math.inf) -> Window | None:
        observer = Observer(window_seconds=1e9)
        for now, scrapes in self.rounds:
            if since <= now <= until:
                observer.record(key, scrapes, now)
        return observer.window(key)


class Tee:
    """The loop's metrics source, also recording into a long measuring window."""

    def __init__(self, url: str, measuring: Recording):
        self.source = UrlMetricsSource([url], timeout=30)
        self.measuring = measuring
        self.reported_max_num_seqs: int | None = None

    async def scrape(self, namespace, name):
        scrapes = await self.source.scrape(namespace, name)
        self.measuring.record(KEY, scrapes, time.time())
        if scrapes and scrapes[0].text:
            gauges = parse_metrics(scrapes[0].text, time.time()).gauges
            value = gauges.get(names.MAX_NUM_SEQS_METRIC)
            self.reported_max_num_seqs = int(value) if value is not None else None
        return scrapes


def loop_score(w: Window | None, targets: Targets) -> dict | None:
    """The window the way the loop judges it (per replica; one replica here)."""
    if w is None or w.span_seconds <= 0:
        return None
    s = score(w, targets)
    return {
        "slo_attainment": s.attainment,
        "requests": s.requests,
        "tokens_per_second": s.throughput,
        "tpot_p90_s": s.tpot_p90,
        "ttft_p99_s": s.ttft_p99,
        "waiting": s.waiting,
        "preemptions_per_minute": w.preemptions_per_minute,
        "seconds": w.span_seconds,
    }


def measured(load: ClosedLoad, observer: Recording, t0: float, t1: float, args) -> dict:
    return {
        "per_request": load.score(t0, t1, args.ttft_target, args.itl_target),
        "loop_score": loop_score(
            observer.window(KEY, since=t0 - 0.5, until=t1 + 0.5), targets(args)
        ),
        "from": t0,
        "to": t1,
    }


def targets(args) -> Targets:
    return Targets(args.ttft_target, args.itl_target)


# --------------------------------------------------------------------------- the arms


async def fixed_arm(url: str, value: int, args) -> dict:
    await set_max_num_seqs(url, value)
    load = ClosedLoad(url, args.concurrency, args.output_lens, args.prompt_repeats)
    observer, source = (
        Recording(),
        UrlMetricsSource([url], timeout=30),
    )
    await load.start()
    try:
        await asyncio.sleep(args.warmup)
        t0 = time.time()
        end = t0 + args.measure
        while True:
            observer.record(KEY, await source.scrape("", ""), time.time())
            if time.time() >= end:
                break
            await asyncio.sleep(min(PERIOD, max(0.0, end - time.time())))
        t1 = time.time()
        out = {"arm": str(value), "max_num_seqs": value, **measured(load, observer, t0, t1, args)}
    finally:
        await load.stop()
    await wait_idle(url)
    return out


def tuning_spec(start: int, args, lo: int, hi: int):
    return parse_spec(
        {"engine": {"maxNumSeqs": start},
         "slo": {"timeToFirstTokenSeconds": args.ttft_target,
                 "interTokenLatencySeconds": args.itl_target},
         "tuning": {"enabled": True, "cooldownSeconds": args.cooldown,
                    "maxNumSeqs": {"min": lo, "max": hi}}}
    )  # fmt: skip


def limits(args) -> TuneLimits:
    """The shipped limits: a bench that shortens them measures another loop."""
    return TuneLimits()


async def looped(url: str, start: int, seconds: float, args, spec, concurrency: int,
                 output_lens, hog_schedule=None) -> dict:  # fmt: skip
    """The load from max_num_seqs ``start``, the real loop every PERIOD s for ``seconds``:
    its decisions, max_num_seqs over time, and the load's per-request record."""
    await set_max_num_seqs(url, start)
    measuring = Recording()
    tee = Tee(url, measuring)
    loop = ClosedLoop(
        tee, AdminClient(timeout=60), observer=Observer(window_seconds=args.window),
        limits=limits(args),
    )  # fmt: skip
    status: dict = {}
    settings = EngineSettings(start)
    decisions, timeline, apply_failures = [], [], []
    hog = hog_schedule[0] if hog_schedule else None
    load = ClosedLoad(url, concurrency, output_lens, args.prompt_repeats)
    await load.start()
    # The loop's first baseline must not hold the load's start-up transient (the first
    # requests meet no queue): the loop starts once the load has run --warmup s.
    await asyncio.sleep(args.warmup)
    t0 = time.time()
    try:
        while (now := time.time()) - t0 < seconds:
            if hog is not None:
                hog.set(hog_schedule[1](now - t0))
            outcome = await loop.run_once("bench", "tune", spec, status, 1, settings, TOKEN)
            for k, v in outcome.status_patch.items():
                status[k] = v
            settings = settings_from_status(status) or settings
            t = round(time.time() - t0, 1)
            d = outcome.tuning
            if d is not None and d.changes:
                decisions.append({
                    "time": t, "action": d.action, "kind": d.kind,
                    "max_num_seqs": d.settings.max_num_seqs, "reason": d.reason,
                    "before": d.before.to_status() if d.before else None,
                    "after": d.after.to_status() if d.after else None,
                })  # fmt: skip
                log(f"  t={t:.0f}s {d.action} {d.kind}: max_num_seqs {d.settings.max_num_seqs}"
                    f" ({d.reason})")  # fmt: skip
            if outcome.apply_failures:
                apply_failures.append({"time": t, **outcome.apply_failures})
            metrics = status.get("metrics") or {}
            timeline.append({
                "time": t, "max_num_seqs": settings.max_num_seqs,
                "reported_max_num_seqs": tee.reported_max_num_seqs,
                "hog": bool(hog and hog.on), "decision": d.action if d else None,
                "reason": d.reason[:160] if d else None,
                "tokens_per_second": metrics.get("generationTokensPerSecond"),
                "itl_p99_s": metrics.get("itlP99Seconds"),
            })  # fmt: skip
            await asyncio.sleep(max(0.0, PERIOD - (time.time() - now)))
        t1 = time.time()
    finally:
        if hog is not None:
            hog.set(False)
        await load.stop()
    await wait_idle(url)
    return {
        "start": start, "t0": t0, "t1": t1, "decisions": decisions, "timeline": timeline,
        "apply_failures": apply_failures, "final_max_num_seqs": settings.max_num_seqs,
        "load": load, "measuring": measuring,
    }  # fmt: skip


async def tuned_arm(url: str, args) -> dict:
    spec = tuning_spec(args.start, args, min(args.values), max(args.values))
    run = await looped(url, args.start, args.tuned_seconds, args, spec, args.concurrency,
                       args.output_lens)  # fmt: skip
    load, measuring, t0, t1 = run.pop("load"), run.pop("measuring"), run["t0"], run["t1"]
    return {
        "arm": "T",
        "max_num_seqs": run["final_max_num_seqs"],
        **measured(load, measuring, t1 - args.measure, t1, args),
        "whole_run": measured(load, measuring, t0 + args.warmup, t1, args),
        **run,
    }


async def arms(url: str, args) -> list[dict]:
    out = []
    for r in range(args.repeats):
        for arm in [*args.values, "T"]:
            lavg = load_average()
            m = await (tuned_arm(url, args) if arm == "T" else fixed_arm(url, arm, args))
            m |= {"repeat": r, "load_average_before": lavg}
            pr, ls = m["per_request"], m["loop_score"] or {}
            log(f"repeat {r} arm {arm} (max_num_seqs {m['max_num_seqs']}): goodput "
                f"{pr['goodput_tokens_per_second']:.1f} per request, "
                f"{ls.get('goodput_tokens_per_second', 0):.1f} as the loop scores it; "
                f"throughput {pr['tokens_per_second']:.1f} tok/s; load {lavg}")  # fmt: skip
            out.append(m)
    return out


def phases(run: dict, args) -> dict:
    """Before the first decision, and after the last verdict (from --warmup s after it)."""
    load, measuring, t0, t1 = run["load"], run["measuring"], run["t0"], run["t1"]
    decisions = run["decisions"]
    first = t0 + (decisions[0]["time"] if decisions else t1 - t0)
    last = t0 + (decisions[-1]["time"] if decisions else 0.0) + args.warmup
    out = {"before_first_decision": measured(load, measuring, t0 + args.warmup, first, args)}
    if t1 - last >= 10:
        out["after_last_verdict"] = measured(load, measuring, last, t1, args)
    return out


@contextlib.contextmanager
def server(serve_args: list[str], log_path: Path, cpus: set[int]):
    """running_server started on ``cpus`` (the engine sizes its torch threads to its
    affinity); this process goes back to its own CPUs for the load and the loop."""
    with contextlib.ExitStack() as stack:
        with affinity(cpus):
            url = stack.enter_context(running_server(serve_args, log_path))
        yield url


async def thrash(args, tmp: Path, cpus: set[int]) -> dict:
    # 13 MiB of float32 KV: 18 blocks of 16 tokens, two sequences at 12 + 96 tokens.
    serve = ["--max-num-seqs", "16", "--kv-cache-memory", "13MiB", "--swap-space", "0.02",
             "--dtype", "float32", "--max-model-len", "256", "--admin-token", TOKEN]  # fmt: skip
    with server(serve, tmp / "thrash-serve.log", cpus) as url:
        spec = tuning_spec(16, args, 1, 16)
        run = await looped(url, 16, args.thrash_seconds, args, spec, args.thrash_concurrency,
                           (96,))  # fmt: skip
    out = phases(run, args)
    run.pop("load"), run.pop("measuring")
    return {**out, **run, "concurrency": args.thrash_concurrency, "output_len": 96}


def hog_schedule(args):
    """Off for the first --hog-period s (a baseline), then on and off in turns."""
    return lambda t: int(t // args.hog_period) % 2 == 1


async def noisy(url: str, start: int, args, cpus: set[int]) -> dict:
    spec = tuning_spec(start, args, min(args.values), max(args.values))
    hog = Hog(cpus)
    try:
        run = await looped(url, start, args.noisy_seconds, args, spec, args.concurrency,
                           args.output_lens, (hog, hog_schedule(args)))  # fmt: skip
    finally:
        hog.close()
    load, measuring, t0, t1 = run.pop("load"), run.pop("measuring"), run["t0"], run["t1"]
    on = hog_schedule(args)
    spans = []  # (start, end, hog on?) relative to t0
    edge = 0.0
    while edge < t1 - t0:
        end = min(t1 - t0, edge + args.hog_period)
        spans.append((edge, end, on(edge)))
        edge = end
    by_phase = [
        {**measured(load, measuring, t0 + a, t0 + b, args), "from": a, "to": b, "hog": h}
        for a, b, h in spans if b - a >= 10
    ]  # fmt: skip
    return {**run, "phases": by_phase, "hog_period_s": args.hog_period}


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: one repeat, two values, short phases")  # fmt: skip
    slo = p.add_argument_group("the service's targets (spec.slo), fixed before the sweep")
    slo.add_argument("--ttft-target", type=float, default=10.0, help="TTFT, seconds")
    slo.add_argument("--itl-target", type=float, default=0.5,
                     help="inter-token latency, seconds: the loop reads its P99 over the gaps; "
                     "per request the mean TPOT is held to it")  # fmt: skip
    w = p.add_argument_group("load and arms")
    w.add_argument("--values", type=ints, default=[8, 16, 32, 48])
    w.add_argument("--start", type=int, default=8, help="the tuned run's starting value")
    w.add_argument("--repeats", type=int, default=3)
    w.add_argument("--concurrency", type=int, default=48, help="closed-loop clients")
    w.add_argument("--output-lens", type=ints, default=[64, 128])
    w.add_argument("--prompt-repeats", type=ints, default=[1, 5, 20])
    w.add_argument("--warmup", type=float, default=10.0)
    w.add_argument("--measure", type=float, default=45.0)
    w.add_argument("--tuned-seconds", type=float, default=200.0)
    w.add_argument("--thrash-seconds", type=float, default=180.0)
    w.add_argument("--thrash-concurrency", type=int, default=8)
    w.add_argument("--noisy-seconds", type=float, default=300.0)
    w.add_argument("--noisy-start", type=int, default=None,
                   help="default: the fixed value with the best mean goodput")  # fmt: skip
    w.add_argument("--hog-period", type=float, default=60.0, help="hog off, then on, each s")
    lp = p.add_argument_group("the loop (TuneLimits and spec.tuning, shortened for a bench)")
    lp.add_argument("--cooldown", type=int, default=20)
    lp.add_argument("--window", type=float, default=60.0, help="the loop's metrics window, s")
    p.add_argument("--server-cpus", type=lambda s: {int(c) for c in s.split(",")}, default=None,
                   help="CPUs to pin the server to (default: the last); the load generator "
                   "and the loop get the others")  # fmt: skip
    p.add_argument("--skip", type=lambda s: set(s.split(",")), default=set(),
                   help="phases to skip: thrash,noisy")  # fmt: skip
    p.add_argument("--result-dir", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.values, args.repeats, args.start = args.values[:1] + args.values[-1:], 1, args.start
        args.warmup, args.measure, args.tuned_seconds = 5.0, 20.0, 60.0
        args.thrash_seconds, args.noisy_seconds, args.hog_period = 60.0, 60.0, 20.0
    return args


async def run(args, tmp: Path, server_cpus: set[int], bench_cpus: set[int]) -> dict:
    out: dict = {}
    serve = ["--max-model-len", "512", "--admin-token", TOKEN, "--max-num-seqs", str(args.start)]
    with server(serve, tmp / "serve.log", server_cpus) as url:
        out["arms"] = await arms(url, args)
        fixed = report.per_arm(out["arms"])
        best = max((a for a in fixed if a["arm"] != "T"),
                   key=lambda a: a["goodput"]["mean"])  # fmt: skip
        if "noisy" not in args.skip:
            start = args.noisy_start or int(best["arm"])
            log(f"noisy neighbour from max_num_seqs {start}")
            out["noisy"] = await noisy(url, start, args, server_cpus)
    if "thrash" not in args.skip:
        log("thrash")
        out["thrash"] = await thrash(args, tmp, server_cpus)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    server_cpus, bench_cpus = split_cpus(args.server_cpus)
    os.sched_setaffinity(0, bench_cpus)
    date = time.strftime("%Y%m%d-%H%M%S")
    tmp = Path(tempfile.mkdtemp(prefix="bench-tune-"))  # server logs
    started, lavg0 = time.time(), load_average()
    log(f"server on CPUs {sorted(server_cpus)}, load and loop on {sorted(bench_cpus)}; "
        f"load average {lavg0}; logs in {tmp}")  # fmt: skip
    results = asyncio.run(run(args, tmp, server_cpus, bench_cpus))
    out = {
        "date": date,
        "wall_seconds": round(time.time() - started),
        "machine": {"lscpu": lscpu(), "server_cpus": sorted(server_cpus),
                    "bench_cpus": sorted(bench_cpus), "load_average_start": lavg0,
                    "load_average_end": load_average()},
        "slo": {"ttft_seconds": args.ttft_target, "itl_seconds": args.itl_target},
        "limits": asdict(limits(args)),
        "args": {k: sorted(v) if isinstance(v, set) else (str(v) if isinstance(v, Path) else v)
                 for k, v in vars(args).items()},
        "summary": report.summary(results, args),
        **results,
    }  # fmt: skip
    print(json.dumps(out["summary"], indent=2))
    suffix = "-quick" if args.quick else ""
    path = args.result_dir / f"tune-{date}{suffix}.json"
    path.write_text(json.dumps(out, indent=2))
    report.plot(out, args.result_dir / f"tune-{date}{suffix}.png")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
