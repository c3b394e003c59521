"""benchmarks/loopsim's replica as a plant that responds: more slots serve more until the
KV cache thrashes, the step budget trades TTFT against ITL, a noisy neighbour slows steps
whatever their batch, and the O(1) bookkeeping leaks no block and loses no token."""

from __future__ import annotations

import statistics

from batchpilot.operator.crd.spec import parse_spec
from benchmarks.loopsim import (
    CPU,
    EngineModel,
    ReplicaConfig,
    ReplicaSim,
    Request,
    ServiceSim,
    StepNoise,
    steady,
)
from benchmarks.loopsim.workloads import heavy_prefill

BLOCK = 368_640  # bytes of one bfloat16 KV block of the bundled model


def fixed(max_num_seqs: int, budget: int | None = None):
    engine = {"maxNumSeqs": max_num_seqs}
    if budget:
        engine["maxNumBatchedTokens"] = budget
    return parse_spec({"engine": engine})


def drained(replica: ReplicaSim, requests: list[Request]) -> ReplicaSim:
    for r in requests:
        replica.submit(r)
    replica.advance_to(1e9)
    return replica


def test_more_slots_serve_more_until_the_kv_cache_thrashes():
    # 1.5 requests/s of the chat mix overload 4 and 8 slots; 240 blocks hold ~10 sequences.
    config = ReplicaConfig(kv_cache_bytes=240 * BLOCK, max_num_batched_tokens=512)
    runs = {
        m: ServiceSim(fixed(m), config).run(steady(1.5), duration=1200, seed=3) for m in (4, 8, 32)
    }
    throughput = {m: r.throughput() for m, r in runs.items()}
    assert throughput[4] < 0.8 * throughput[8], throughput
    assert runs[8].trace[-1].preemptions == 0
    assert runs[32].trace[-1].preemptions > 50  # past the KV cache: preemption
    assert throughput[32] < 1.5 * throughput[8], throughput  # and the gain stops


def share_of_gaps_over(replica: ReplicaSim, seconds: float) -> float:
    """The share of inter-token gaps longer than ``seconds`` (a bucket bound)."""
    h = replica.itl
    over = sum(c for b, c in zip((*h.bounds, float("inf")), h.counts, strict=True) if b > seconds)
    return over / sum(h.counts)


def test_the_step_budget_trades_ttft_against_itl():
    """Long prompts in small chunks: first tokens later, decodes never wait long; in one
    chunk: first tokens sooner, and every decode in that step waits for the whole prompt.
    (The prefill work is the same either way, so mean TPOT barely moves: the budget moves
    the worst gaps.)"""
    ttft, long_gaps = {}, {}
    for budget in (128, 2048):
        sim = ServiceSim(fixed(16, budget), ReplicaConfig(max_num_batched_tokens=budget))
        r = sim.run(heavy_prefill(0.6, (512, 768, 1024)), duration=1200, seed=1)
        ttft[budget] = statistics.mean(x.ttft for x in r.requests)
        long_gaps[budget] = share_of_gaps_over(sim.pods[0].engine, 0.3)
    assert ttft[2048] < 0.7 * ttft[128], ttft
    assert long_gaps[128] == 0 < long_gaps[2048], long_gaps


def test_a_prompt_over_the_budget_is_prefilled_in_chunks():
    model = EngineModel()
    replica = drained(
        ReplicaSim("r", ReplicaConfig(max_num_batched_tokens=256), model, 0.0),
        [Request(0.0, 1000, 2)],
    )
    (done,) = replica.done
    # 256 + 256 + 256 + 232 tokens: four steps before the first token.
    expected = 4 * model.step_base_s + 1000 * model.prefill_per_token_s
    assert abs(done.ttft - expected) < 1e-9


def test_a_noisy_neighbour_slows_steps_whatever_their_batch():
    def mean_step(batch: int, noise: StepNoise | None) -> float:
        replica = ReplicaSim("r", ReplicaConfig(max_num_seqs=64), CPU.model, 0.0, noise, seed=5)
        drained(replica, [Request(0.0, 32, 400) for _ in range(batch)])
        return replica.done[-1].finish / replica.steps

    noise = StepNoise(probability=0.2, factor=4.0)  # expected slowdown 1 + 0.2 x 3 = 1.6
    for batch in (1, 32):
        slowdown = mean_step(batch, noise) / mean_step(batch, None)
        assert 1.45 < slowdown < 1.75, (batch, slowdown)


def test_bookkeeping_returns_every_block_and_counts_every_token():
    """Through preemption to swap and to recompute (no swap space), chunked prefill and
    live changes, an idle replica holds no block and generated what was asked."""
    requests = [Request(i * 0.05, 64 + 37 * (i % 9), 16 + 29 * (i % 7)) for i in range(300)]
    for swap in (4 << 30, 0):
        config = ReplicaConfig(
            max_num_seqs=48, kv_cache_bytes=120 * BLOCK, swap_space_bytes=swap,
            max_num_batched_tokens=200,
        )  # fmt: skip
        replica = ReplicaSim("r", config, CPU.model, 0.0)
        for r in requests:
            replica.advance_to(r.arrival)
            replica.submit(r)
            if r.arrival == 5.0:
                replica.max_num_seqs, replica.max_num_batched_tokens = 8, 512  # a live change
        replica.advance_to(1e9)
        assert replica.counters["preemptions"] > 0
        assert replica.free_blocks == replica.num_blocks
        assert replica.finished == len(requests)
        assert not replica.has_work()
        assert sorted(d.output_len for d in replica.done) == sorted(r.output_len for r in requests)
        emitted = replica.counters["gen"]
        assert emitted == sum(r.output_len for r in requests)


def test_per_request_slo_is_ttft_and_mean_tpot():
    spec = parse_spec(
        {"engine": {"maxNumSeqs": 8},
         "slo": {"timeToFirstTokenSeconds": 1.0, "interTokenLatencySeconds": 0.08}}
    )  # fmt: skip
    result = ServiceSim(spec).run(steady(0.5), duration=600, seed=2)
    assert result.slo == (1.0, 0.08)
    good = [r for r in result.requests if r.ttft <= 1.0 and r.tpot <= 0.08]
    assert 0 < len(good) < len(result.requests)
    assert result.goodput() == sum(r.output_len for r in good) / 600
