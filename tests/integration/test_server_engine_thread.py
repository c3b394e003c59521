"""AsyncEngine with the real engine on the tiny model, in-process: outputs reach the event
loop once per step however many requests run, and an abort frees the request's KV blocks
before the engine's next step."""

import asyncio

from batchpilot.server.config import EngineConfig
from batchpilot.server.engine.async_engine import AsyncEngine
from batchpilot.server.sampling.sampling_params import SamplingParams


def make_async_engine(tiny_path, steps: list) -> AsyncEngine:
    from batchpilot.server.engine.llm_engine import LLMEngine

    config = EngineConfig(model=tiny_path, dtype="float32", max_model_len=512,
                          kv_cache_memory_bytes=16 << 20, swap_space_bytes=1 << 20)  # fmt: skip
    return AsyncEngine(lambda: LLMEngine(config), steps.append)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_one_delivery_per_step_for_many_requests(tiny_path):
    deliveries: list = []

    async def run():
        engine = make_async_engine(tiny_path, deliveries)
        engine.start()
        await engine.loaded
        streams = await asyncio.gather(
            *(engine.submit([(f"r{i}", f"prompt {i}", params(12))]) for i in range(8))
        )

        async def drain(stream):
            return [out async for outs in stream for out in outs]

        outputs = await asyncio.gather(*(drain(s) for s in streams))
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(run())
    assert all(outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12 for outs in outputs)
    stepped = [d for d in deliveries if d.stepped]
    # Exactly one hand-over per engine step, each carrying that step's outputs for every
    # running request: far fewer loop callbacks than tokens.
    assert len(stepped) == stepped[-1].stats.num_steps
    assert sum(len(d.outputs) for d in stepped) >= 8 * 12
    assert max(len(d.outputs) for d in stepped) == 8


def test_abort_frees_blocks_before_the_next_step(tiny_path):
    async def run():
        engine = make_async_engine(tiny_path, [])
        engine.start()
        await engine.loaded
        stream = await engine.submit([("long", "a long story", params(400))])
        for _ in range(3):
            await stream.__anext__()
        steps_at_close = engine.stats.num_steps
        assert engine.stats.num_free_kv_blocks < engine.stats.num_kv_blocks
        stream.close()
        # Runs on the engine thread after it took the abort, before any step that follows.
        stats = await engine.call(lambda e: e.stats())
        await engine.shutdown()
        return steps_at_close, stats

    steps_at_close, stats = asyncio.run(run())
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.num_running == 0 and stats.num_waiting == 0
    # Step k+1 may be under way when the client leaves; the engine thread applies the abort
    # before it starts step k+2, and the stats call lands in that pass or the next one.
    assert stats.num_steps <= steps_at_close + 2
