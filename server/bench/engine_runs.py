"""batchpilot's side of the offline comparison: the whole workload through LLM.generate."""

import gc
import time

from batchpilot.server.bench.systems import SystemRun, TokenRequest


def batchpilot_generate(
    requests: list[TokenRequest], policy: str, engine_kwargs: dict, warmup: list[TokenRequest]
) -> SystemRun:
    """All requests submitted at once; `policy` is "continuous" or "static" (a batch is
    admitted together and nothing joins until all of it has finished)."""
    from batchpilot.server import LLM, SamplingParams

    llm = LLM(scheduling_policy=policy, **engine_kwargs)
    try:
        _generate(llm, SamplingParams, warmup)
        # The warm-up ran the workload's own prompts; its KV must not serve the timed run.
        llm.reset_prefix_cache()
        before = llm.stats()
        start = time.perf_counter()
        outputs = _generate(llm, SamplingParams, requests)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        after = llm.stats()
    finally:
        del llm
        gc.collect()
    steps = after.num_steps - before.num_steps
    preemptions = after.num_preemptions - before.num_preemptions
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    note = f"{steps} steps, {preemptions} preemptions, prefix cache hits {hits}/{queries} tokens"
    return SystemRun(f"batchpilot {policy}", len(requests), produced, produced, seconds, note)


def _generate(llm, sampling_params, requests: list[TokenRequest]):
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        sampling_params(max_tokens=r.output_len, temperature=0.0, ignore_eos=True, seed=i)
        for i, r in enumerate(requests)
    ]
    return llm.generate(prompts, params, use_tqdm=False)
