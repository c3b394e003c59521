"""The closed loop on real `batchpilot serve` processes (bundled model, 127.0.0.1): the URL
metrics source feeds the real observe → tune → apply path, `batchpilot bench serve` makes
the load, and the decision reaches the servers through /admin/config."""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import pytest
from test_server_harness import BATCHPILOT, ServerProcess

from batchpilot import names
from batchpilot.operator.admin_client import AdminClient
from batchpilot.operator.crd import parse_spec
from batchpilot.operator.loop import ClosedLoop
from batchpilot.operator.observe import Observer, UrlMetricsSource
from batchpilot.operator.tune import EngineSettings, TuneLimits

pytestmark = pytest.mark.slow

TOKEN = "loop-test-token"
PERIOD = 2.0  # the loop's period here; the operator's timer is slower
DEADLINE = 240.0
# Short windows and cooldown so that a few minutes of CPU serving show several decisions.
LIMITS = TuneLimits(min_window_seconds=6.0)


def tuning_spec(max_num_seqs: int, lo: int, hi: int) -> object:
    return parse_spec(
        {"engine": {"maxNumSeqs": max_num_seqs},
         "tuning": {"enabled": True, "cooldownSeconds": 10, "targetInterTokenLatencySeconds": 30,
                    "maxNumSeqs": {"min": lo, "max": hi}}}
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


def make_loop(urls: list[str]) -> ClosedLoop:
    # Generous timeouts: two servers and their load share two busy cores.
    return ClosedLoop(
        UrlMetricsSource(urls, timeout=15), AdminClient(timeout=30),
        observer=Observer(window_seconds=20), limits=LIMITS,
    )  # fmt: skip


async def drive(loop: ClosedLoop, spec, settings, done, servers: int, outcomes: list) -> dict:
    """Run the loop every PERIOD until ``done(outcome, status)``; returns the status."""
    status: dict = {}
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        outcome = await loop.run_once("default", "chat", spec, status, servers, settings, TOKEN)
        status.update(outcome.status_patch)
        outcomes.append(outcome)
        tuned = status["tuning"]
        settings = EngineSettings(
            tuned[names.MAX_NUM_SEQS.crd_field], tuned[names.KV_CACHE_DTYPE.crd_field]
        )
        if done(outcome, status):
            return status
        await asyncio.sleep(PERIOD)
    raise AssertionError(f"not done within {DEADLINE} s; last status: {status}")


def test_slot_bound_load_raises_max_num_seqs_on_both_servers(tmp_path):
    servers = [serve(tmp_path, f"s{i}", "--max-num-seqs", "2") for i in range(2)]
    load = [bench_load(s, tmp_path, concurrency=8, output_len=96) for s in servers]
    try:
        loop = make_loop([s.url for s in servers])
        spec = tuning_spec(2, lo=2, hi=8)

        def raised_everywhere(outcome, status) -> bool:
            # A PATCH that times out on a busy server is retried by the next turn's repair.
            return any(o.tuning.kind == "raise" for o in outcomes) and all(
                s.metric(names.MAX_NUM_SEQS_METRIC) == 4 for s in servers
            )

        outcomes: list = []
        status = asyncio.run(drive(loop, spec, EngineSettings(2), raised_everywhere, 2, outcomes))
        raised = next(o for o in outcomes if o.tuning.kind == "raise")
        assert raised.tuning.max_num_seqs == 4
        assert raised.tuning.inputs["waitingPerReplica"] > 0
        for server in servers:
            assert server.metric(names.MAX_NUM_SEQS_METRIC) == 4
            config = httpx.get(f"{server.url}/admin/config", timeout=10,
                               headers={"Authorization": f"Bearer {TOKEN}"}).json()  # fmt: skip
            assert config[names.MAX_NUM_SEQS.name] == 4
        assert status["tuning"]["history"][-1]["kind"] == "raise"
    finally:
        stop(load)
        for server in servers:
            server.stop()


def test_a_swap_thrashing_server_is_brought_out_of_the_thrash(tmp_path):
    # 30 MiB of float32 KV: 42 blocks of 16 tokens, three sequences at 12 + 200 tokens; 16
    # slots admit far more than fit, and they preempt each other as they grow.
    server = serve(tmp_path, "thrash", "--max-num-seqs", "16", "--kv-cache-memory", "30MiB",
                   "--swap-space", "0.02")  # fmt: skip
    load = [bench_load(server, tmp_path, concurrency=16, output_len=200)]
    try:
        loop = make_loop([server.url])
        spec = tuning_spec(16, lo=1, hi=16)

        def thrash_stopped(outcome, status) -> bool:
            lowered = any(h["kind"] == "lower" for h in status["tuning"].get("history", []))
            inputs = outcome.tuning.inputs
            calm = (
                inputs.get("windowSeconds", 0) >= 12
                and inputs["preemptionsPerMinutePerReplica"] <= LIMITS.thrash_per_minute
                and inputs["runningPerReplica"] > 0
            )
            return lowered and outcome.tuning.kind == "hold" and calm

        outcomes: list = []
        status = asyncio.run(drive(loop, spec, EngineSettings(16), thrash_stopped, 1, outcomes))
        first = next(o for o in outcomes if o.tuning.kind == "lower")
        assert "memory-bound" in first.tuning.reason
        final = status["tuning"][names.MAX_NUM_SEQS.crd_field]
        assert 1 <= final < 16
        assert server.metric(names.MAX_NUM_SEQS_METRIC) == final
    finally:
        stop(load)
        server.stop()
