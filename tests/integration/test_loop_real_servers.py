"""The closed loop on real `batchpilot serve` processes (bundled model, 127.0.0.1): the URL
metrics source feeds the real observe → tune → apply path, `batchpilot bench serve` makes
the load, and the loop v3 acts at once through /admin/config: a queue with every slot busy
raises max_num_seqs on every server with no test, and KV thrash puts a lower (at most
halving) under its no-harm test at once, with no dwell."""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import pytest

from batchpilot import names
from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.admin_client import AdminClient
from batchpilot.operator.loop.guardrails import TuneLimits
from batchpilot.operator.loop.observe import Observer
from batchpilot.operator.loop.scrape import UrlMetricsSource
from batchpilot.operator.loop.tuner_state import EngineSettings
from batchpilot.operator.loop.turn import ClosedLoop
from tests.support.servers import BATCHPILOT, ServerProcess

pytestmark = pytest.mark.slow

TOKEN = "loop-test-token"
PERIOD = 2.0  # the loop's period here; the operator's timer is slower
DEADLINE = 480.0
# Short windows so that a few minutes of CPU serving show a guardrail's move.
LIMITS = TuneLimits(min_window_seconds=10.0)


def tuning_spec(max_num_seqs: int, lo: int, hi: int) -> object:
    return parse_spec(
        {"engine": {"maxNumSeqs": max_num_seqs},
         "tuning": {"enabled": True, "maxNumSeqs": {"min": lo, "max": hi}},
         # Loose targets: no latency guardrail; only the queue and the thrash ones act.
         "slo": {"timeToFirstTokenSeconds": 600, "interTokenLatencySeconds": 30}}
    )  # fmt: skip


def serve(tmp_path, name: str, *flags: str) -> ServerProcess:
    args = ["--dtype", "float32", "--max-model-len", "256", "--admin-token", TOKEN, *flags]
    return ServerProcess(args, tmp_path / f"{name}.log").start()


def bench_load(server: ServerProcess, tmp_path, concurrency: int, output_len: int):
    """`batchpilot bench serve` in the background: more concurrent requests than slots."""
    return subprocess.Popen(
        [BATCHPILOT, "bench", "serve", "--url", server.url, "--request-rate", "inf",
         "--max-concurrency", str(concurrency), "--num-prompts", str(4 * concurrency),
         "--output-lens", str(output_len), "--prompt-repeats", "1", "--num-warmups", "0",
         "--result-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def stop(processes) -> None:
    for p in processes:
        p.kill()
        p.wait()


def make_loop(servers: list[ServerProcess]) -> ClosedLoop:
    # Generous timeouts: two servers and their load share two busy cores. Each server's
    # admin API has its own port.
    urls, admin_urls = [s.url for s in servers], [s.admin_url for s in servers]
    return ClosedLoop(
        UrlMetricsSource(urls, admin_urls, timeout=15), AdminClient(timeout=30),
        observer=Observer(window_seconds=30), limits=LIMITS,
    )  # fmt: skip


async def drive(loop: ClosedLoop, spec, settings, done, servers: int, outcomes: list) -> dict:
    """Run the loop every PERIOD until ``done(outcome, status)``; returns the status."""
    status: dict = {}
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        outcome = await loop.run_once("default", "chat", spec, status, servers, settings, TOKEN)
        status.update(outcome.status_patch)
        outcomes.append(outcome)
        settings = EngineSettings.from_status(status["tuning"])
        if done(outcome, status):
            return status
        await asyncio.sleep(PERIOD)
    raise AssertionError(f"not done within {DEADLINE} s; last status: {status}")


def kinds(status: dict, action: str) -> list[dict]:
    return [h for h in status["tuning"].get("history", []) if h["action"] == action]


def test_a_queue_with_every_slot_busy_raises_on_both_servers_at_once(tmp_path):
    servers = [serve(tmp_path, f"s{i}", "--max-num-seqs", "2") for i in range(2)]
    load = [bench_load(s, tmp_path, concurrency=8, output_len=96) for s in servers]
    try:
        loop = make_loop(servers)
        spec = tuning_spec(2, lo=2, hi=8)

        def raised(outcome, status) -> bool:
            return bool(kinds(status, "guard"))

        outcomes: list = []
        status = asyncio.run(drive(loop, spec, EngineSettings(2), raised, 2, outcomes))
        guard = kinds(status, "guard")[0]
        assert guard["kind"] == "raise" and guard["reason"].startswith("guardrail: queue:"), guard
        assert 2 < guard["maxNumSeqs"] <= 8, guard
        # No trial: the guardrail's move is in force on every server at once.
        assert not kinds(status, "canary") and not kinds(status, "try"), status["tuning"]
        assert status["tuning"]["experiment"] is None
        assert any(r == "TuningGuardrail" for o in outcomes for r, _ in o.events)
        target = guard["maxNumSeqs"]

        def everywhere(outcome, status) -> bool:  # what is in force (a later raise may follow)
            in_force = status["tuning"][names.MAX_NUM_SEQS.crd_field]
            return all(s.metric(names.MAX_NUM_SEQS_METRIC) == in_force for s in servers)

        status = asyncio.run(drive(loop, spec, EngineSettings(target), everywhere, 2, outcomes))
        for server in servers:
            config = httpx.get(f"{server.admin_url}/admin/config", timeout=60,
                               headers={"Authorization": f"Bearer {TOKEN}"}).json()  # fmt: skip
            assert config[names.MAX_NUM_SEQS.name] == status["tuning"]["maxNumSeqs"] >= target
    finally:
        stop(load)
        for server in servers:
            server.stop()


def test_kv_thrash_tries_a_lower_at_once_at_most_halving(tmp_path):
    # 30 MiB of float32 KV: 42 blocks of 16 tokens, three sequences at 12 + 200 tokens; 16
    # slots admit far more than fit, and they preempt each other as they grow.
    server = serve(tmp_path, "thrash", "--max-num-seqs", "16", "--kv-cache-memory", "30MiB",
                   "--swap-space", "0.02")  # fmt: skip
    load = [bench_load(server, tmp_path, concurrency=16, output_len=200)]
    try:
        loop = make_loop([server])
        spec = tuning_spec(16, lo=1, hi=16)

        def tried(h: dict) -> bool:
            return h["kind"] == "lower" and h["reason"].startswith("testing: KV thrash:")

        def lowered(outcome, status) -> bool:
            return any(tried(h) for h in kinds(status, "try"))

        outcomes: list = []
        status = asyncio.run(drive(loop, spec, EngineSettings(16), lowered, 1, outcomes))
        trial = next(h for h in kinds(status, "try") if tried(h))
        assert 8 <= trial["maxNumSeqs"] < 16, trial  # at most halving
        # One server: the lower is in force on it while its test runs.
        e = status["tuning"]["experiment"]
        assert (
            e is not None and e["kind"] == "lower" and e["to"]["maxNumSeqs"] == trial["maxNumSeqs"]
        )
        assert any(r == "TuningTrial" for o in outcomes for r, _ in o.events)
        in_force = status["tuning"][names.MAX_NUM_SEQS.crd_field]
        assert in_force == trial["maxNumSeqs"]

        def applied(outcome, status) -> bool:
            return (
                server.metric(names.MAX_NUM_SEQS_METRIC)
                == status["tuning"][names.MAX_NUM_SEQS.crd_field]
            )

        asyncio.run(drive(loop, spec, EngineSettings(in_force), applied, 1, outcomes))
    finally:
        stop(load)
        server.stop()
