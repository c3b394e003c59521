"""The closed loop on real `batchpilot serve` processes (bundled model, 127.0.0.1): the URL
metrics source feeds the real observe → tune → apply path, `batchpilot bench serve` makes
the load, and each change is tried, judged on goodput and kept or reverted through
/admin/config."""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import pytest

from batchpilot import names
from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.admin_client import AdminClient
from batchpilot.operator.loop.observe import Observer
from batchpilot.operator.loop.scrape import UrlMetricsSource
from batchpilot.operator.loop.tune_rules import TuneLimits
from batchpilot.operator.loop.tuner_state import EngineSettings
from batchpilot.operator.loop.turn import ClosedLoop
from tests.support.servers import BATCHPILOT, ServerProcess

pytestmark = pytest.mark.slow

TOKEN = "loop-test-token"
PERIOD = 2.0  # the loop's period here; the operator's timer is slower
DEADLINE = 480.0
# Short windows and few samples so that a few minutes of CPU serving show a whole trial.
LIMITS = TuneLimits(min_window_seconds=10.0, min_latency_samples=30)


def tuning_spec(max_num_seqs: int, lo: int, hi: int) -> object:
    return parse_spec(
        {"engine": {"maxNumSeqs": max_num_seqs},
         "tuning": {"enabled": True, "cooldownSeconds": 10, "maxNumSeqs": {"min": lo, "max": hi}},
         # Loose targets: under a queue every request is within them, so goodput is
         # throughput and the verdict rests on it.
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


def test_a_slot_bound_raise_runs_on_a_canary_and_reaches_both_servers_once_kept(tmp_path):
    servers = [serve(tmp_path, f"s{i}", "--max-num-seqs", "2") for i in range(2)]
    load = [bench_load(s, tmp_path, concurrency=8, output_len=96) for s in servers]
    try:
        loop = make_loop(servers)
        spec = tuning_spec(2, lo=2, hi=8)
        canary_seen: list[int] = []

        def judged(outcome, status) -> bool:
            if status["tuning"].get("experiment"):
                # While on trial only the canary runs the raise; the other keeps 2.
                canary_seen.append(sorted(s.metric(names.MAX_NUM_SEQS_METRIC) for s in servers))
            return bool(kinds(status, "rollout") or kinds(status, "revert"))

        outcomes: list = []
        status = asyncio.run(drive(loop, spec, EngineSettings(2), judged, 2, outcomes))
        tried = kinds(status, "canary")[0]
        assert tried["kind"] == "raise" and tried["maxNumSeqs"] == 2, tried  # all keep 2
        assert [2, 4] in canary_seen, canary_seen
        verdict = (kinds(status, "rollout") or kinds(status, "revert"))[0]
        assert verdict["before"]["goodputTokensPerSecond"] > 0, verdict
        # Four slots per replica under a queue of eight generate more than two: kept.
        assert verdict["action"] == "rollout", verdict
        assert (
            verdict["after"]["goodputTokensPerSecond"] > verdict["before"]["goodputTokensPerSecond"]
        )

        def everywhere(outcome, status) -> bool:
            return all(s.metric(names.MAX_NUM_SEQS_METRIC) == 4 for s in servers)

        asyncio.run(drive(loop, spec, EngineSettings(4), everywhere, 2, outcomes))
        for server in servers:
            config = httpx.get(f"{server.admin_url}/admin/config", timeout=60,
                               headers={"Authorization": f"Bearer {TOKEN}"}).json()  # fmt: skip
            assert config[names.MAX_NUM_SEQS.name] == 4
    finally:
        stop(load)
        for server in servers:
            server.stop()


def test_a_memory_bound_lower_is_judged_on_goodput_not_on_preemptions(tmp_path):
    # 30 MiB of float32 KV: 42 blocks of 16 tokens, three sequences at 12 + 200 tokens; 16
    # slots admit far more than fit, and they preempt each other as they grow.
    server = serve(tmp_path, "thrash", "--max-num-seqs", "16", "--kv-cache-memory", "30MiB",
                   "--swap-space", "0.02")  # fmt: skip
    load = [bench_load(server, tmp_path, concurrency=16, output_len=200)]
    try:
        loop = make_loop([server])
        spec = tuning_spec(16, lo=1, hi=16)

        def judged(outcome, status) -> bool:
            return bool(kinds(status, "keep") or kinds(status, "revert"))

        outcomes: list = []
        status = asyncio.run(drive(loop, spec, EngineSettings(16), judged, 1, outcomes))
        tried = kinds(status, "try")[0]
        assert tried["kind"] == "lower" and "memory-bound" in tried["reason"], tried
        verdict = (kinds(status, "keep") or kinds(status, "revert"))[0]
        before, after = verdict["before"], verdict["after"]
        # The verdict compares goodput (or its share within the SLO), whatever preemptions did.
        assert "goodput" in verdict["reason"] or "attainment" in verdict["reason"], verdict
        better = after["goodputTokensPerSecond"] > before["goodputTokensPerSecond"]
        assert (verdict["action"] == "keep") == better or "attainment" in verdict["reason"]
        in_force = status["tuning"][names.MAX_NUM_SEQS.crd_field]
        assert in_force == (tried["maxNumSeqs"] if verdict["action"] == "keep" else 16)

        def applied(outcome, status) -> bool:
            return server.metric(names.MAX_NUM_SEQS_METRIC) == in_force

        asyncio.run(drive(loop, spec, EngineSettings(in_force), applied, 1, outcomes))
    finally:
        stop(load)
        server.stop()
