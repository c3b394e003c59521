"""Every replica of every InferenceService, in one process: R ports on 127.0.0.1, each a
replica's /metrics (the server's names, changing with wall time) and admin API (accepting
every change). kwok's pods serve nothing, so the operator reads these instead (its
--metrics-urls / --admin-urls override: one list for every service).

`python -m benchmarks.operator_scale.fake_replicas PORT...` serves until killed."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from batchpilot import names
from benchmarks.loopsim.metrics import (
    ITL_BUCKETS,
    MODEL_NAME,
    REQUEST_TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    StepCells,
    activity_families,
)

# A modest steady load: about 2 requests/s per replica of ~500 prompt and ~150 output
# tokens, with a slow swing, so the loop's windows see moving counters, never a flat line.
ARRIVALS_PER_SECOND = 2.0
PROMPT_TOKENS, OUTPUT_TOKENS = 500, 150
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 256, 2048
# /metrics is rendered once per tick and served from memory: N services x R replicas are
# scraped every loop interval, and this process must not be the bottleneck it measures.
TICK_SECONDS = 1.0


class FakeReplica:
    """One replica's counters, advanced by wall time."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.phase = self.rng.uniform(0, 2 * math.pi)
        self.counters = dict.fromkeys(("arrivals", "prompt", "gen", "preemptions"), 0.0)
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.prompt_tokens = Histogram(REQUEST_TOKEN_BUCKETS)
        self.generation_tokens = Histogram(REQUEST_TOKEN_BUCKETS)
        self.steps = StepCells()
        self.running = 0
        self.config = {
            names.MAX_NUM_SEQS.name: MAX_NUM_SEQS,
            names.MAX_NUM_BATCHED_TOKENS.name: MAX_NUM_BATCHED_TOKENS,
        }

    def advance(self, now: float, seconds: float) -> None:
        rate = ARRIVALS_PER_SECOND * (1 + 0.3 * math.sin(now / 60 + self.phase))
        n = max(0, round(self.rng.gauss(rate * seconds, math.sqrt(rate * seconds))))
        self.running = max(1, round(rate * 3))
        self.counters["arrivals"] += n
        self.counters["prompt"] += n * PROMPT_TOKENS
        self.counters["gen"] += n * OUTPUT_TOKENS
        tpot = 0.02 + 0.0004 * self.running
        for _ in range(n):
            self.ttft.observe(self.rng.uniform(0.05, 0.3))
            self.tpot.observe(tpot * self.rng.uniform(0.9, 1.1))
            self.prompt_tokens.observe(PROMPT_TOKENS)
            self.generation_tokens.observe(OUTPUT_TOKENS)
        self.itl.observe(tpot, n * OUTPUT_TOKENS)
        steps = max(1, round(seconds / tpot))
        context = self.running * (PROMPT_TOKENS + OUTPUT_TOKENS // 2)
        self.steps.record(self.running, tpot, self.running - 1, PROMPT_TOKENS, context)
        for _ in range(steps - 1):
            self.steps.record(self.running, tpot, self.running, 0, context)

    def collect(self):
        label = [names.METRIC_LABEL]
        gauges = (
            (names.NUM_REQUESTS_RUNNING, self.running),
            (names.NUM_REQUESTS_WAITING, 0),
            (names.NUM_REQUESTS_SWAPPED, 0),
            (names.KV_CACHE_USAGE, min(1.0, self.running / MAX_NUM_SEQS)),
            (names.MAX_NUM_SEQS_METRIC, self.config[names.MAX_NUM_SEQS.name]),
            (names.MAX_NUM_BATCHED_TOKENS_METRIC, self.config[names.MAX_NUM_BATCHED_TOKENS.name]),
            (names.OLDEST_WAITING_SECONDS, 0.0),
        )
        for name, value in gauges:
            family = GaugeMetricFamily(name, name, labels=label)
            family.add_metric([MODEL_NAME], value)
            yield family
        yield from activity_families(self)
        yield from self.steps.families()

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)


class ReplicaServer:
    """One replica's HTTP side: the latest rendering, and an admin API that takes any
    change and answers it back in force (what set_live checks)."""

    def __init__(self, replica: FakeReplica):
        self.replica = replica
        self.body = replica.render()

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.get("/metrics", self.metrics),
                web.get("/admin/config", self.get_config),
                web.patch("/admin/config", self.patch_config),
                web.get("/admin/lora_adapters", self.adapters),
                web.post("/admin/lora_adapters/{action}", self.adapter_change),
            ]
        )
        return app

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.body, content_type="text/plain")

    async def get_config(self, _: web.Request) -> web.Response:
        return web.json_response(self.replica.config)

    async def patch_config(self, request: web.Request) -> web.Response:
        self.replica.config.update(await request.json())
        return web.json_response(self.replica.config)

    async def adapters(self, _: web.Request) -> web.Response:
        return web.json_response({"data": []})

    async def adapter_change(self, _: web.Request) -> web.Response:
        return web.json_response({})


async def serve(ports: list[int]) -> None:
    servers = [ReplicaServer(FakeReplica(seed=port)) for port in ports]
    for port, server in zip(ports, servers, strict=True):
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    last = time.time()
    while True:
        await asyncio.sleep(TICK_SECONDS)
        now = time.time()
        for server in servers:
            server.replica.advance(now, now - last)
            server.body = server.replica.render()
        last = now


if __name__ == "__main__":
    asyncio.run(serve([int(p) for p in sys.argv[1:]]))
