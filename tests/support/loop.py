"""The closed loop's unit-test doubles: metric windows made to order, the loop v3's model
inputs made to order (step cells of a known plant, a ready model and demand, per-request
histograms with a given share within a target), and simulated replicas (benchmarks/loopsim)
behind the two interfaces the loop talks to; FakeServer, the exposition text a real
server writes."""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import SimpleNamespace

from batchpilot import names
from batchpilot.operator.loop.demand import Demand
from batchpilot.operator.loop.model_state import ModelState
from batchpilot.operator.loop.observe import Buckets, Window
from batchpilot.operator.loop.observe_steps import StepCell
from batchpilot.operator.loop.plant import StepModel
from batchpilot.operator.loop.scrape import Scrape
from batchpilot.server.api import metrics as server_metrics
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


# --------------------------------------------------------------------------- loop v3 inputs

# A known plant: step seconds = a + b x decodes + c x context (k tokens) + d x prefill (100s).
BETA = (0.02, 0.002, 0.001, 0.004)
# A workload: 1 request/s per replica, 200-token prompts and 100-token answers.
DEMAND = Demand(rate=1.0, prompt_mean=200.0, output_mean=100.0, prompt_p95=400.0,
                output_p95=200.0, seconds=600.0, requests=100.0)  # fmt: skip


def step_seconds(n: float, context: float, prefill: float, beta=BETA) -> float:
    a, b, c, d = beta
    return a + b * n + c * context / 1000 + d * prefill / 100


def step_cells(
    batches: Iterable[float] = (1, 2, 4, 8, 16),
    *,
    steps: float = 100.0,
    context: float = 600.0,
    beta=BETA,
    scale: float = 1.0,
    noise=None,
) -> tuple[StepCell, ...]:
    """One cell per batch size (its bucket) and phase, as a server's counters give them, of
    ``steps`` steps each, timed by the plant ``beta`` x ``scale`` (x ``noise()`` per cell,
    when given): decode steps carry ``context`` tokens per sequence and no prefill, mixed
    ones three times the context and 256 prefill tokens (so that every term is seen apart)."""
    out = []
    for n in batches:
        for phase, per_seq, prefill in (("decode", context, 0.0), ("mixed", 3 * context, 256.0)):
            t = scale * step_seconds(n, n * per_seq, prefill, beta)
            t *= noise() if noise is not None else 1.0
            out.append(StepCell(n, phase, steps, t * steps, n * steps, n * steps,
                                prefill * steps, n * per_seq * steps))  # fmt: skip
    return tuple(out)


def ready_model(batches=(1, 2, 4, 8, 16), demand: Demand = DEMAND, now=0.0, **kw) -> ModelState:
    """A model fitted on ``step_cells(batches)`` and ``demand``: ready to plan."""
    return ModelState(step=StepModel().ingest(step_cells(batches, **kw), now), demand=demand)


def within(share: float, target: float, n: float) -> Buckets:
    """A cumulative histogram of ``n`` observations, ``share`` of them at or under
    ``target`` (share_within(…, target) == share), the rest past every bound."""
    if n <= 0:
        return ()
    return ((target, share * n), (math.inf, float(n)))


def replica(
    url: str = "http://r0",
    *,
    running=6.0,
    waiting=0.0,
    max_num_seqs=8,
    dtype: str | None = "auto",
    budget=None,
    kv=0.2,
    kv_peak=None,
    preemptions=0.0,
    tokens=100.0,
    span=60.0,
    finished=100.0,
    tpot_share=1.0,
    ttft_share=1.0,
    target=0.1,
    ttft_target=2.0,
    oldest_waiting=0.0,
    steps: tuple[StepCell, ...] = (),
    arrivals=1.0,
    kv_blocks: int | None = None,
) -> Window:
    """One replica's window as the v3 loop reads it; ``max_num_seqs``/``dtype`` None: it
    reports nothing (unknown counts as running anything)."""
    return Window(
        replicas=1,
        span_seconds=span,
        waiting=waiting,
        running=running,
        swapped=0.0,
        kv_cache_usage=kv,
        kv_cache_usage_peak=kv if kv_peak is None else kv_peak,
        preemptions_per_minute=preemptions,
        swaps_per_minute=0.0,
        generation_tokens_per_second=tokens,
        waiting_now=waiting,
        running_now=running,
        ttft_buckets=within(ttft_share, ttft_target, finished),
        max_num_seqs={url: max_num_seqs} if max_num_seqs is not None else {},
        max_num_batched_tokens={url: budget} if budget else {},
        kv_cache_dtype={url: dtype} if dtype else {},
        tpot_buckets=within(tpot_share, target, finished),
        requests_finished=finished,
        prompt_tokens_sum=200.0 * finished,
        output_tokens_sum=100.0 * finished,
        arrivals_per_second=arrivals,
        oldest_waiting_seconds=oldest_waiting,
        steps=steps,
        kv_num_blocks={url: kv_blocks} if kv_blocks else {},
        kv_block_size=16 if kv_blocks else None,
    )


def replicas(n: int, **kw) -> dict[str, Window]:
    return {f"http://r{i}": replica(f"http://r{i}", **kw) for i in range(n)}


class Replicas:
    """Simulated replicas behind the two interfaces the loop talks to: a metrics source
    and the admin client's set_live (which records what it was asked; a URL in
    ``refusing`` answers 400). Each request has a 64-token prompt and ``output`` tokens."""

    def __init__(self, count: int, max_num_seqs: int = 4, output: int = 512):
        self.output = output
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
                engine.submit(Request(now, 64, self.output))

    def advance(self, t: float) -> None:
        for engine in self.engines.values():
            engine.advance_to(t)

    def top_up(self, in_system: int, now: float) -> None:
        """Clients that keep ``in_system`` requests on each replica (a steady queue)."""
        for engine in self.engines.values():
            for _ in range(in_system - len(engine.running) - len(engine.waiting)):
                engine.submit(Request(now, 64, self.output))

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


SERVER_STATS = {  # what FakeServer's engine reports until a test changes it
    "num_running": 3,
    "num_waiting": 5,
    "num_swapped": 1,
    "kv_cache_usage": 0.25,
    "cpu_cache_usage": 0.0,
    "max_num_seqs": 8,
    "num_preemptions": 0,
    "prompt_tokens_total": 0,
    "generation_tokens_total": 0,
    "num_swaps_out": 0,
    "num_swaps_in": 0,
    "kv_cache_dtype": "fp8",
    "block_size": 16,
    "num_kv_blocks": 100,
    "max_num_batched_tokens": 512,
    "num_arrivals": 0,
    "prefix_cache_queries": 0,
    "prefix_cache_hits": 0,
    "oldest_waiting_arrival": None,  # none waits
    # LoRA off (max_lora 0): no vllm:lora_requests_info family.
    "max_lora": 0,
    "running_lora_adapters": (),
    "waiting_lora_adapters": (),
    # No CUDA graphs (a CPU server): no batchpilot:decode_graphs_info family.
    "decode_graph_sizes": (),
}


class FakeServer:
    """The server's own metrics registry (server/api/metrics.py) over engine stats: the
    exact exposition text a `batchpilot serve` writes."""

    def __init__(self):
        self.stats = dict(SERVER_STATS)
        self.metrics = server_metrics.ServerMetrics("m", lambda: SimpleNamespace(**self.stats))

    def text(self) -> str:
        return self.metrics.render()[0].decode()
