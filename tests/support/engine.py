"""Data the engine tests share: prompts that cover scripts, lengths and code, and the
engine conditions (batching, chunking, preemption) every equivalence test runs under."""

PROMPTS = [
    "Hello world",
    "The capital of France is",
    "请解释一下机器学习",
    "请解释一下" + "机器学习" * 5,
    "Once upon a time, in a land far away, there lived a small dragon who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2,
    "Q: What is 2 + 2?\nA:",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
]

BLOCK_BYTES_TINY = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 slots, 2 heads, dim 16, fp32

CONDITIONS = {
    "batched": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "preempt_swap": dict(kv_cache_memory_bytes=16 * BLOCK_BYTES_TINY, preemption_mode="swap"),
    "preempt_recompute": dict(
        kv_cache_memory_bytes=16 * BLOCK_BYTES_TINY, preemption_mode="recompute"
    ),
    "preempt_swap_exhausted": dict(
        kv_cache_memory_bytes=16 * BLOCK_BYTES_TINY, swap_space_bytes=4 * BLOCK_BYTES_TINY
    ),
    "no_prefix_cache_no_chunking": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    # The timing at start-up picks torch for the tiny model's shapes; this forces oneDNN.
    "linear_onednn": dict(linear_backend="onednn", max_num_batched_tokens=8),
}


def run_to_completion(core, request_id: str, prompt: list[int], max_tokens: int = 3) -> None:
    """One greedy request through an EngineCore's turns (as the server drives it), until
    the engine has nothing left to do."""
    from batchpilot.server.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.turn([([(request_id, prompt, params)], 0.0, None)], [], [])
    while core.has_work():
        core.turn([], [], [])
