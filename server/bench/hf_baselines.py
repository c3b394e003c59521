"""The transformers peers of the offline comparison, all fed the same token ids with EOS
suppressed (min_new_tokens = max_new_tokens), so every system does the same useful work."""

import time

import torch

from batchpilot.server.bench.systems import SystemRun, TokenRequest


def _generate(model, input_ids, attention_mask, new_tokens: int, pad_token_id: int):
    return model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
    )


@torch.inference_mode()
def hf_sequential(
    model, tokenizer, requests: list[TokenRequest], warmup: list[TokenRequest]
) -> SystemRun:
    """One request at a time: the unbatched floor."""
    pad = tokenizer.pad_token_id
    for r in warmup:
        ids = torch.tensor([r.prompt_token_ids])
        _generate(model, ids, torch.ones_like(ids), r.output_len, pad)
    start = time.perf_counter()
    produced = 0
    for r in requests:
        ids = torch.tensor([r.prompt_token_ids])
        out = _generate(model, ids, torch.ones_like(ids), r.output_len, pad)
        produced += out.shape[1] - ids.shape[1]
    seconds = time.perf_counter() - start
    return SystemRun("hf sequential generate()", len(requests), produced, produced, seconds)


def _left_padded(batch: list[TokenRequest], pad: int):
    """Left padding keeps every row's last prompt token at the same position for decoding."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids) :] = 1
    return ids, mask


@torch.inference_mode()
def hf_static(
    model, tokenizer, requests: list[TokenRequest], batch_size: int, warmup: list[TokenRequest]
) -> SystemRun:
    """Padded batches in arrival order: every row runs as long as the batch's longest output,
    and no request joins until the whole batch is done."""
    pad = tokenizer.pad_token_id
    _generate(model, *_left_padded(warmup, pad), max(r.output_len for r in warmup), pad)
    start = time.perf_counter()
    computed = useful = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        ids, mask = _left_padded(batch, pad)
        out = _generate(model, ids, mask, max(r.output_len for r in batch), pad)
        computed += (out.shape[1] - ids.shape[1]) * len(batch)
        useful += sum(r.output_len for r in batch)
    seconds = time.perf_counter() - start
    return SystemRun("hf static batching", len(requests), computed, useful, seconds)


@torch.inference_mode()
def hf_generate_batch(
    model, requests: list[TokenRequest], batch_size: int, warmup: list[TokenRequest]
) -> SystemRun:
    """transformers' own continuous batching (paged KV cache, sdpa attention), each request
    with its own output length."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation("sdpa")
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    page = 16
    pages_per_request = -(-longest // page)
    config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=pages_per_request * batch_size + 1,
        max_requests_per_batch=batch_size,
        max_batch_tokens=2048,
        auto_switch_to_flash=False,
    )
    generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=config, warmup=False
    ) as manager:
        _run_to_completion(manager, warmup)
        start = time.perf_counter()
        outputs = _run_to_completion(manager, requests)
        seconds = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outputs)
    return SystemRun("hf generate_batch (paged|sdpa)", len(requests), produced, produced, seconds)


def _run_to_completion(manager, requests: list[TokenRequest]) -> list:
    """generate_batch's loop, with a per-request output length, which it lacks."""
    ids = [
        manager.add_request(r.prompt_token_ids, max_new_tokens=r.output_len, eos_token_id=-1)
        for r in requests
    ]
    outputs = {}
    while len(outputs) < len(ids):
        result = manager.get_result(timeout=120)
        if result is None:
            raise RuntimeError("transformers generate_batch stopped before finishing")
        if result.error is not None:
            raise RuntimeError(f"transformers generate_batch failed: {result.error}")
        if result.is_finished():
            outputs[result.request_id] = result
    return list(outputs.values())
