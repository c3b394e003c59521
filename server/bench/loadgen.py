"""The online load generator: warm-up, then requests at Poisson arrival times and/or under a
concurrency cap, all streamed and timed. Drives any OpenAI-compatible server."""

import asyncio
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from batchpilot.server.bench.arrivals import arrival_offsets
from batchpilot.server.bench.client import RequestResult, completion_payload, stream_completion
from batchpilot.server.bench.workload import BenchRequest


@dataclass
class LoadSpec:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first id from GET /v1/models
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    burstiness: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    api_key: str | None = None
    num_warmups: int = 1
    timeout_s: float = 600.0


@dataclass
class LoadResult:
    model: str
    results: list[RequestResult]
    duration_s: float  # first send (after warm-up) to last completion


async def discover_model(client: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_load(spec: LoadSpec, requests: list[BenchRequest], progress: bool) -> LoadResult:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    url = f"{spec.base_url}/v1/completions"
    # Enough connections for every request in flight, so the client never queues them.
    limit = spec.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit + 1, max_keepalive_connections=limit + 1)
    timeout = httpx.Timeout(spec.timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = spec.model or await discover_model(client, spec.base_url, headers)

        def payload(r: BenchRequest) -> dict:
            return completion_payload(model, r.prompt, r.output_len, spec.ignore_eos)

        for r in requests[: spec.num_warmups]:
            warm = await stream_completion(client, url, payload(r), headers)
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        gate = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
        offsets = arrival_offsets(len(requests), spec.request_rate, spec.seed, spec.burstiness)
        start = time.perf_counter()

        async def one(r: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if gate is None:
                result = await stream_completion(client, url, payload(r), headers)
            else:
                async with gate:
                    result = await stream_completion(client, url, payload(r), headers)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
        bar.close()
    return LoadResult(model=model, results=list(results), duration_s=duration)
