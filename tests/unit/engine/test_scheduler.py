"""Scheduler invariants checked at every step of real engine runs on the tiny model."""

import random

import pytest

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.engine.admission import RequestRejected
from batchpilot.server.engine.sequence import Status

BLOCK_BYTES_TINY = 2 * 2 * 16 * 2 * 16 * 4

CONFIGS = [
    dict(max_num_seqs=4, max_num_batched_tokens=16),
    dict(max_num_seqs=8, kv_cache_memory_bytes=14 * BLOCK_BYTES_TINY, preemption_mode="swap",
         swap_space_bytes=6 * BLOCK_BYTES_TINY),
    dict(max_num_seqs=16, kv_cache_memory_bytes=10 * BLOCK_BYTES_TINY, preemption_mode="recompute",
         max_num_batched_tokens=24),
    dict(max_num_seqs=3, scheduling_policy="static"),
]  # fmt: skip


def random_workload(seed: int, n: int = 14):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 5000) for _ in range(rng.randrange(1, 60))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 40), temperature=rng.choice([0.0, 0.8]),
                       seed=rng.randrange(1000), ignore_eos=True)
        for _ in range(n)
    ]  # fmt: skip
    return prompts, params


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_every_step_respects_limits_and_every_request_finishes(tiny_model, config):
    llm = LLM(tiny_model, dtype="float32", max_model_len=128, **config)
    engine = llm.engine
    cfg = engine.config
    schedule = engine.scheduler.schedule
    static_batches = []

    def checked_schedule():
        admitted_before = {id(s) for s in engine.scheduler.running}
        decision = schedule()
        assert decision.num_tokens <= cfg.max_num_batched_tokens
        assert len(engine.scheduler.running) <= cfg.max_num_seqs
        assert engine.kv_manager.swap.num_free >= 0
        in_swap = sum(len(s.cpu_block_table) for s in engine.scheduler.swapped)
        assert in_swap + engine.kv_manager.swap.num_free == engine.kv_manager.swap.num_blocks
        for seq, n in decision.scheduled:
            assert seq.status == Status.RUNNING and 1 <= n <= seq.num_uncomputed_tokens
        new = {id(s) for s in engine.scheduler.running} - admitted_before
        if cfg.scheduling_policy == "static" and new:
            assert not admitted_before, "static mode admitted while a batch was running"
            static_batches.append(len(new))
        return decision

    engine.scheduler.schedule = checked_schedule
    prompts, params = random_workload(seed=len(str(config)))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        assert out.finished and len(out.outputs[0].token_ids) == p.max_tokens
    stats = llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    if cfg.kv_cache_memory_bytes:
        assert stats.num_preemptions > 0
    if cfg.scheduling_policy == "static":
        assert static_batches and max(static_batches) <= cfg.max_num_seqs


def test_requests_that_can_never_fit_are_rejected_without_blocking_others(tiny_model):
    llm = LLM(tiny_model, dtype="float32", max_model_len=64,
              kv_cache_memory_bytes=6 * BLOCK_BYTES_TINY)  # fmt: skip
    engine = llm.engine
    with pytest.raises(RequestRejected, match="maximum context length is 64 tokens"):
        engine.add_request("long", list(range(1, 70)), SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match=r"you requested 74 tokens \(10 in the messages"):
        engine.add_request("sum", list(range(1, 11)), SamplingParams(max_tokens=64))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=5), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5


def test_abort_frees_blocks_immediately(tiny_model):
    llm = LLM(tiny_model, dtype="float32", max_model_len=128)
    engine = llm.engine
    engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.stats().num_free_kv_blocks < engine.stats().num_kv_blocks
    engine.abort_request("a")
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_lowering_max_num_seqs_lets_running_sequences_finish(tiny_model):
    llm = LLM(tiny_model, dtype="float32", max_model_len=128, max_num_seqs=4)
    engine = llm.engine
    for i in range(6):
        engine.add_request(str(i), [10 + i] * 5, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.stats().num_running == 4
    engine.config.apply_live_change({"max_num_seqs": 1})
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length"
                finished.add(out.request_id)
        assert engine.stats().num_running <= 4
    assert finished == {str(i) for i in range(6)}
