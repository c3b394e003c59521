"""Engine efficiency: batchpilot's decode throughput against a bare forward pass of the same
model at the same batch size and context, i.e. how much the scheduler, the paged KV
bookkeeping, the sampler and the detokenizer cost on top of the arithmetic.

The bare forward is transformers' model with its own KV cache, called in a loop with greedy
argmax and nothing else, so the ratio also carries any kernel difference between the two
models (paged attention vs a contiguous cache); the JSON says so."""

import time

import torch

from batchpilot.server.bench.systems import TokenRequest


def engine_decode_tok_s(engine, prompt: list[int], batch_size: int, steps: int) -> float:
    """Admit batch_size copies of the prompt, wait until all decode, then time `steps`
    engine steps in which every sequence makes one token."""
    from batchpilot.server import SamplingParams

    # Copies admitted in the first prefill steps are a few tokens ahead of the last ones;
    # the headroom keeps every copy decoding through all timed steps.
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(batch_size):
        # A distinct first token per copy keeps prefix caching from sharing the prompt.
        first = (prompt[0] + i) % engine.vocab_size
        engine.add_request(f"eff-{i}", [first, *prompt[1:]], params)
    produced = {f"eff-{i}": 0 for i in range(batch_size)}
    while min(produced.values()) < 1:
        for out in engine.step():
            produced[out.request_id] += len(out.outputs[0].delta_token_ids)
    start = time.perf_counter()
    made = 0
    for _ in range(steps):
        made += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    for request_id in produced:
        engine.abort_request(request_id)
    engine.step()
    if made != batch_size * steps:
        raise RuntimeError(f"expected {batch_size * steps} decode tokens, got {made}")
    return made / seconds


@torch.inference_mode()
def raw_forward_tok_s(hf_model, prompt: list[int], batch_size: int, steps: int) -> float:
    from transformers import DynamicCache

    ids = torch.tensor([prompt] * batch_size)
    cache = DynamicCache()
    logits = hf_model(input_ids=ids, cache=cache, use_cache=True).logits
    next_ids = logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        logits = hf_model(input_ids=next_ids, cache=cache, use_cache=True).logits
        next_ids = logits[:, -1:].argmax(-1)
    return batch_size * steps / (time.perf_counter() - start)


def measure_efficiency(engine, hf_model, request: TokenRequest, batch_size: int, steps: int):
    engine_rate = engine_decode_tok_s(engine, request.prompt_token_ids, batch_size, steps)
    raw_rate = raw_forward_tok_s(hf_model, request.prompt_token_ids, batch_size, steps)
    return {
        "batch_size": batch_size,
        "context_len": len(request.prompt_token_ids),
        "decode_steps": steps,
        "engine_decode_tok_s": engine_rate,
        "raw_forward_tok_s": raw_rate,
        "efficiency": engine_rate / raw_rate,
        "raw_forward": "transformers forward + DynamicCache + argmax, no scheduler",
    }
