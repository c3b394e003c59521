"""A closed-loop or open-loop (Poisson) load in the benchmark's own process, timed per
request and per token, and goodput scored from those timings.

The requests are `batchpilot bench serve`'s (server/bench/workload.py, EOS ignored) and are
timed as its client times them (server/bench/client.py: TTFT from send to the first token
chunk, ITL between chunks, TPOT the mean gap after the first token), but every token's
arrival time is kept as it comes, so that a measuring window can be cut out of a load that
keeps running (the bench client only reports once its whole request list is done).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from batchpilot.server.bench.client import completion_payload
from batchpilot.server.bench.loadgen import discover_model
from batchpilot.server.bench.workload import make_workload


@dataclass
class Request:
    sent: float  # wall clock
    output_len: int
    tokens: list[float] = field(default_factory=list)  # arrival time of each token chunk
    usage_tokens: int = 0  # completion_tokens from the final usage chunk (0: not seen)
    done: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.tokens[0] - self.sent if self.tokens else None

    @property
    def generated(self) -> int:
        """Tokens generated: the usage count once done (a chunk may carry several tokens
        when the engine's outputs coalesce behind a slow reader), else the chunks seen."""
        return max(self.usage_tokens, len(self.tokens))

    @property
    def weight(self) -> float:
        """Tokens per chunk."""
        return self.generated / len(self.tokens) if self.tokens else 0.0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, as the bench client computes it."""
        if len(self.tokens) < 2 or self.generated < 2:
            return None
        return (self.tokens[-1] - self.tokens[0]) / (self.generated - 1)

    def meets(self, ttft_target: float, itl_target: float) -> bool:
        """Per request, as `vllm bench serve --goodput ttft:..,tpot:..` judges it."""
        ttft, tpot = self.ttft, self.tpot
        return ttft is not None and ttft <= ttft_target and (tpot is None or tpot <= itl_target)


async def _stream(client: httpx.AsyncClient, url: str, payload: dict, r: Request) -> None:
    """server/bench/client.stream_completion, recording each token chunk's arrival time."""
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                r.error = f"HTTP {response.status_code}"
                return
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or not data or data == "[DONE]":
                    continue
                event = json.loads(data)
                if event.get("choices"):
                    r.tokens.append(time.time())
                if event.get("usage"):
                    r.usage_tokens = event["usage"].get("completion_tokens", 0)
        r.done = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"


class _Load:
    """Requests of one seeded workload against one server, each timed as it streams."""

    def __init__(self, url: str, output_lens, prompt_repeats, seed: int, connections: int):
        self.url = url.rstrip("/")
        self.workload = make_workload(4096, seed, tuple(output_lens), tuple(prompt_repeats))
        self.requests: list[Request] = []
        self.connections = connections
        self._tasks: list[asyncio.Task] = []
        self._client: httpx.AsyncClient | None = None
        self._model = ""

    async def _open(self) -> None:
        limits = httpx.Limits(max_connections=self.connections)
        self._client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900, connect=10))
        self._model = await discover_model(self._client, self.url, {})

    async def _send(self, w) -> Request:
        r = Request(time.time(), w.output_len)
        self.requests.append(r)
        payload = completion_payload(self._model, w.prompt, w.output_len, ignore_eos=True)
        await _stream(self._client, f"{self.url}/v1/completions", payload, r)
        return r

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._client is not None:
            await self._client.aclose()

    def score(self, t0: float, t1: float, ttft_target: float, itl_target: float) -> dict:
        return score_requests(self.requests, t0, t1, ttft_target, itl_target)


class ClosedLoad(_Load):
    """``concurrency`` clients, each sending its next request when the last one ends."""

    def __init__(self, url: str, concurrency: int, output_lens, prompt_repeats, seed: int = 0):
        super().__init__(url, output_lens, prompt_repeats, seed, concurrency + 2)
        self.concurrency = concurrency

    async def start(self, t0: float) -> None:
        """The clients start together at ``t0`` (wall clock)."""
        await self._open()
        order = itertools.cycle(self.workload)
        await asyncio.sleep(max(0.0, t0 - time.time()))

        async def client() -> None:
            while True:
                if (await self._send(next(order))).error:
                    await asyncio.sleep(1.0)

        self._tasks = [asyncio.create_task(client()) for _ in range(self.concurrency)]


def poisson_arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of ``rate`` per second over ``seconds``:
    the same seed gives every server the same arrival times."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out


class PoissonLoad(_Load):
    """Open loop: request i is sent at ``t0 + arrivals[i]`` whatever the server's state,
    so a server past its capacity builds a queue (vLLM bench serve's --request-rate)."""

    def __init__(self, url: str, arrivals: list[float], output_lens, prompt_repeats,
                 seed: int = 0):  # fmt: skip
        # No connection cap: a cap would turn the open loop back into a closed one.
        super().__init__(url, output_lens, prompt_repeats, seed, len(arrivals) + 2)
        self.arrivals = arrivals

    async def start(self, t0: float) -> None:
        await self._open()

        async def dispatch() -> None:
            sends = []
            for offset, w in zip(self.arrivals, itertools.cycle(self.workload)):
                await asyncio.sleep(max(0.0, t0 + offset - time.time()))
                sends.append(asyncio.create_task(self._send(w)))
            try:
                await asyncio.gather(*sends)
            finally:
                for s in sends:
                    s.cancel()

        self._tasks = [asyncio.create_task(dispatch())]


def score_requests(
    requests: list[Request], t0: float, t1: float, ttft_target: float, itl_target: float
) -> dict:
    """Tokens/s that arrived in [t0, t1), and of those, the tokens of requests that met both
    targets (judged on all their tokens seen by the time the load stopped; a request cut off
    by the stop is judged on its part)."""
    span = t1 - t0
    tokens = good = 0
    met = judged = 0
    for r in requests:
        n = r.weight * sum(1 for t in r.tokens if t0 <= t < t1)
        if n == 0:
            continue
        ok = r.meets(ttft_target, itl_target)
        tokens += n
        good += n if ok else 0
        judged += 1
        met += ok
    ttfts = sorted(r.ttft for r in requests if r.ttft is not None and t0 <= r.tokens[0] < t1)
    return {
        "tokens_per_second": tokens / span if span > 0 else 0.0,
        "goodput_tokens_per_second": good / span if span > 0 else 0.0,
        "requests_seen": judged,
        "requests_meeting_slo": met,
        "ttft_median_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "errors": sum(1 for r in requests if r.error and r.sent < t1),
    }
