"""One measuring window of benchmarks/tune.py: every arm on its own server, all started
at the same instant under identical copies of the load, scored over the same span.

An arm is "T" (the real loop, ``ClosedLoop`` with the shipped ``TuneLimits``, a fresh
tuner from the start value, a turn every operator loop interval) or a fixed
``max_num_seqs``. The loop starts when the shared warm-up ends, which is also where
scoring starts, so the tuned arm's learning is inside its score.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from batchpilot import names
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.loop.admin_client import AdminClient
from batchpilot.operator.loop.guardrails import TuneLimits
from batchpilot.operator.loop.observe import Observer, parse_metrics
from batchpilot.operator.loop.scrape import UrlMetricsSource
from batchpilot.operator.loop.state import settings_from_status
from batchpilot.operator.loop.tuner_state import EngineSettings
from batchpilot.operator.loop.turn import ClosedLoop
from benchmarks.realtune.machine import Hog

TOKEN = "bench-tune-token"
LOOP_INTERVAL = OperatorConfig.model_fields["loop_interval"].default  # the shipped period
BUSY = (names.NUM_REQUESTS_RUNNING, names.NUM_REQUESTS_WAITING, names.NUM_REQUESTS_SWAPPED)


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


@dataclass(frozen=True)
class Server:
    url: str
    admin_url: str
    cpus: frozenset[int]


@dataclass(frozen=True)
class Plan:
    """What every arm of a window shares."""

    warmup: float  # s of load before scoring (and the loop) starts
    measure: float  # s scored
    load: Callable[[str, float], object]  # (url, t0) -> a started-later load, same seed
    spec: Callable[[int], InferenceServiceSpec]  # the tuned arm's spec from a start value
    ttft_target: float
    itl_target: float
    hog_period: float | None = None  # hog beside every server: off, on, ... in turns


async def set_max_num_seqs(server: Server, value: int) -> None:
    failures = await AdminClient(timeout=60).set_live(
        [server.admin_url], TOKEN, {names.MAX_NUM_SEQS.name: value}
    )
    if failures[server.admin_url]:
        raise RuntimeError(failures[server.admin_url])


async def wait_idle(server: Server, timeout: float = 600.0) -> None:
    """Until the requests a stopped load left behind have left the engine."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() < deadline:
            text = (await client.get(f"{server.url}/metrics")).text
            if not any(parse_metrics(text, time.time()).gauges.get(n, 0.0) for n in BUSY):
                return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{server.url} still busy after {timeout} s")


def hog_on(plan: Plan, since_scoring: float) -> bool:
    """Off for the first hog period of the scored span (a baseline), then on and off."""
    return plan.hog_period is not None and int(since_scoring // plan.hog_period) % 2 == 1


def _live(s: EngineSettings) -> dict:
    return {"max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens}


async def tuned(server: Server, start: int, plan: Plan, t_score: float, t_end: float) -> dict:
    """The real loop on ``server`` from ``t_score`` to ``t_end``: every decision that
    changed something (with the settings before and after, and whether the hog was on)."""
    spec = plan.spec(start)
    loop = ClosedLoop(
        UrlMetricsSource([server.url], [server.admin_url], timeout=30), AdminClient(timeout=60),
        observer=Observer(), limits=TuneLimits(),
    )  # fmt: skip
    status: dict = {}
    settings = EngineSettings(start)
    decisions = []
    await asyncio.sleep(max(0.0, t_score - time.time()))
    while (now := time.time()) < t_end:
        outcome = await loop.run_once("bench", "tune", spec, status, 1, settings, TOKEN)
        status.update(outcome.status_patch)
        after = settings_from_status(status) or settings
        d = outcome.tuning
        if d is not None and d.changes:
            t = round(now - t_score, 1)
            decisions.append({
                "time": t, "action": d.action, "kind": d.kind, "before": _live(settings),
                "after": _live(after), "hog": hog_on(plan, now - t_score),
                "reason": d.reason[:200],
            })  # fmt: skip
            log(f"  {server.url} t={t:.0f}s {d.action} {d.kind}: max_num_seqs "
                f"{settings.max_num_seqs} -> {after.max_num_seqs}")  # fmt: skip
        settings = after
        await asyncio.sleep(max(0.0, min(LOOP_INTERVAL - (time.time() - now), t_end - time.time())))
    return {"decisions": decisions, "final": _live(settings)}


async def _hogs(servers: list[Server], plan: Plan, t_score: float, t_end: float) -> list[dict]:
    """One hog beside each server, all switched together; the episodes, relative to
    ``t_score``."""
    hogs = [Hog(set(s.cpus)) for s in servers]
    episodes: list[dict] = []
    try:
        await asyncio.sleep(max(0.0, t_score - time.time()))
        while (now := time.time()) < t_end:
            on = hog_on(plan, now - t_score)
            if on and not hogs[0].on:
                episodes.append({"from": round(now - t_score, 1), "to": None})
            if not on and hogs[0].on:
                episodes[-1]["to"] = round(now - t_score, 1)
            for h in hogs:
                h.set(on)
            await asyncio.sleep(1.0)
    finally:
        for h in hogs:
            h.close()
    if episodes and episodes[-1]["to"] is None:
        episodes[-1]["to"] = round(t_end - t_score, 1)
    return episodes


async def run(servers: list[Server], arms: list[str], start: int, fixed: dict[str, int],
              plan: Plan) -> dict:  # fmt: skip
    """``arms[i]`` on ``servers[i]``; a fixed arm's label maps to its value in ``fixed``."""
    for server, arm in zip(servers, arms, strict=True):
        await set_max_num_seqs(server, start if arm == "T" else fixed[arm])
    t0 = time.time() + 2.0  # every load's clients are ready before the shared start
    t_score, t_end = t0 + plan.warmup, t0 + plan.warmup + plan.measure
    loads = [plan.load(s.url, t0) for s in servers]
    await asyncio.gather(*(load.start(t0) for load in loads))
    hogs = asyncio.create_task(_hogs(servers, plan, t_score, t_end)) if plan.hog_period else None
    loops = {i: asyncio.create_task(tuned(s, start, plan, t_score, t_end))
             for i, (s, a) in enumerate(zip(servers, arms, strict=True)) if a == "T"}  # fmt: skip
    try:
        await asyncio.sleep(max(0.0, t_end - time.time()))
        results = {i: await task for i, task in loops.items()}
        episodes = await hogs if hogs else []
    finally:
        for task in [*loops.values(), *([hogs] if hogs else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for load in loads:
            await load.stop()
    await asyncio.gather(*(wait_idle(s) for s in servers))
    half = t_score + plan.measure / 2
    out = []
    for i, (server, arm, load) in enumerate(zip(servers, arms, loads, strict=True)):
        whole = load.score(t_score, t_end, plan.ttft_target, plan.itl_target)
        second = load.score(half, t_end, plan.ttft_target, plan.itl_target)
        row = {
            "arm": arm, "server": i, "cpus": sorted(server.cpus),
            "goodput_whole": round(whole["goodput_tokens_per_second"], 3),
            "goodput_second_half": round(second["goodput_tokens_per_second"], 3),
            "throughput_whole": round(whole["tokens_per_second"], 3),
            "requests_meeting_slo": f"{whole['requests_meeting_slo']}/{whole['requests_seen']}",
            "ttft_median_s": whole["ttft_median_s"], "errors": whole["errors"],
        }  # fmt: skip
        if arm == "T":
            row |= {"start": start, **results[i]}
        else:
            row["max_num_seqs"] = fixed[arm]
        out.append(row)
    return {"t0": t0, "t_score": t_score, "t_end": t_end, "arms": out, "hog_episodes": episodes}
