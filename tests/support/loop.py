"""The closed loop's unit-test doubles: metric windows made to order, and simulated
replicas (benchmarks/loopsim) behind the two interfaces the loop talks to."""

from __future__ import annotations

import math

from batchpilot import names
from batchpilot.operator.loop.observe import Window
from batchpilot.operator.loop.scrape import Scrape
from benchmarks.loopsim import EngineModel, ReplicaConfig, ReplicaSim, Request


def window(
    *,
    replicas=1,
    running=0.0,
    waiting=0.0,
    kv=0.1,
    kv_peak=None,
    preemptions=0.0,
    swaps=0.0,
    itl_p99=None,
    tokens=0.0,
    max_num_seqs=8,
    span=60.0,
    budget=None,
    dtype="auto",
) -> Window:
    """Totals over ``replicas`` (running/waiting are per replica here, for readability)."""
    itl = () if itl_p99 is None else ((0.0, 0.0), (itl_p99 / 0.99, 1e3), (math.inf, 1e3))
    urls = [f"http://r{i}" for i in range(replicas)]
    return Window(
        replicas=replicas,
        span_seconds=span,
        waiting=waiting * replicas,
        running=running * replicas,
        swapped=0.0,
        kv_cache_usage=kv,
        kv_cache_usage_peak=kv if kv_peak is None else kv_peak,
        preemptions_per_minute=preemptions * replicas,
        swaps_per_minute=swaps * replicas,
        generation_tokens_per_second=tokens * replicas,
        waiting_now=waiting * replicas,
        running_now=running * replicas,
        itl_buckets=itl,
        max_num_seqs=dict.fromkeys(urls, max_num_seqs),
        max_num_batched_tokens=dict.fromkeys(urls, budget) if budget else {},
        kv_cache_dtype=dict.fromkeys(urls, dtype),
    )


def tw(**kw) -> Window:
    """A window with enough ITL observations to judge by (P99 50 ms unless given)."""
    kw.setdefault("itl_p99", 0.05)
    return window(**kw)


class Replicas:
    """Simulated replicas behind the two interfaces the loop talks to: a metrics source
    and the admin client's set_live (which records what it was asked; a URL in
    ``refusing`` answers 400)."""

    def __init__(self, count: int, max_num_seqs: int = 4):
        config = ReplicaConfig(max_num_seqs=max_num_seqs)
        self.engines = {
            f"http://r{i}": ReplicaSim(f"http://r{i}", config, EngineModel(), 0.0)
            for i in range(count)
        }
        self.down: set[str] = set()
        self.patches: list[tuple[str, int]] = []
        self.refusing: set[str] = set()

    def load(self, requests: int, now: float) -> None:
        for engine in self.engines.values():
            for _ in range(requests):
                engine.submit(Request(now, 64, 512))

    def advance(self, t: float) -> None:
        for engine in self.engines.values():
            engine.advance_to(t)

    def top_up(self, in_system: int, now: float) -> None:
        """Clients that keep ``in_system`` requests on each replica (a steady queue)."""
        for engine in self.engines.values():
            for _ in range(in_system - len(engine.running) - len(engine.waiting)):
                engine.submit(Request(now, 64, 512))

    async def scrape(self, namespace: str, name: str) -> list[Scrape]:
        # Each replica's admin API listens on its own port, apart from /metrics.
        return [
            Scrape(url, error="refused", admin_url=f"{url}:8001")
            if url in self.down
            else Scrape(url, text=e.metrics_text(), admin_url=f"{url}:8001")
            for url, e in self.engines.items()
        ]

    async def set_live(self, urls, token: str, changes: dict) -> dict[str, str | None]:
        assert token == "secret" and set(changes) == {names.MAX_NUM_SEQS.name}
        value = changes[names.MAX_NUM_SEQS.name]
        answers = {}
        for admin_url in urls:
            url = admin_url.removesuffix(":8001")
            assert admin_url == f"{url}:8001", "the admin API is called on its own port"
            self.patches.append((url, value))
            if url in self.refusing:
                answers[admin_url] = "HTTP 400: max_num_seqs is more than this replica can hold"
                continue
            self.engines[url].max_num_seqs = value
            answers[admin_url] = None
        return answers
