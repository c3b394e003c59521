"""Sampled-token and prompt logprobs from the engine equal log_softmax of transformers'
float32 logits for the same tokens, top-N alternatives included, under batching,
chunked prefill, prefix-cache hits and preemption (swap and recompute)."""

import pytest
import torch

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.model.loader import load_hf_model
from tests.support.engine import BLOCK_BYTES_TINY, PROMPTS

MAX_TOKENS = 24  # enough growth to force preemption in 16 blocks
NUM_LOGPROBS = 4
ATOL = 1e-4  # float32 on both sides; the engine's paged attention sums in another order

CONDITIONS = {
    "batched": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "preempt_swap": dict(kv_cache_memory_bytes=16 * BLOCK_BYTES_TINY, preemption_mode="swap"),
    "preempt_recompute": dict(
        kv_cache_memory_bytes=16 * BLOCK_BYTES_TINY, preemption_mode="recompute"
    ),
}


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model):
    """token ids -> [len, vocab] float32 log_softmax of transformers' logits."""
    model, _ = load_hf_model(tiny_model, torch.float32)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return logprobs


def check_against_hf(out, hf_logprobs, prompt_logprobs: bool = True) -> None:
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    reference = hf_logprobs(ids)
    num_prompt = len(out.prompt_token_ids)
    scored = list(range(num_prompt, len(ids)))
    positions = list(completion.logprobs)
    if prompt_logprobs:
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == num_prompt
        scored = list(range(1, len(ids)))
        positions = out.prompt_logprobs[1:] + positions
    assert len(positions) == len(scored)
    for index, position in zip(scored, positions, strict=True):
        row = reference[index - 1]  # position index - 1 predicts token index
        token = ids[index]
        assert position[token].logprob == pytest.approx(row[token].item(), abs=ATOL)
        # The rank counts tokens at least as likely; near-ties may order either way.
        rank_bounds = (
            int((row > row[token] + ATOL).sum()) + 1,
            int((row >= row[token] - ATOL).sum()),
        )
        assert rank_bounds[0] <= position[token].rank <= rank_bounds[1]
        top = sorted((t for t in position if t != token or position[t].rank <= NUM_LOGPROBS),
                     key=lambda t: position[t].rank)  # fmt: skip
        assert len(top) == NUM_LOGPROBS
        expected = row.topk(NUM_LOGPROBS)
        torch.testing.assert_close(torch.tensor([position[t].logprob for t in top]),
                                   expected.values, rtol=0, atol=ATOL)  # fmt: skip


def params(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed, ignore_eos=True,
                          logprobs=NUM_LOGPROBS, **kwargs)  # fmt: skip


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_logprobs_match_transformers(tiny_model, hf_logprobs, condition):
    llm = LLM(tiny_model, dtype="float32", max_model_len=128, **CONDITIONS[condition])
    batch = [params(i, prompt_logprobs=NUM_LOGPROBS) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, batch, use_tqdm=False)
    for out in outs:
        check_against_hf(out, hf_logprobs)
    if condition.startswith("preempt"):
        assert llm.stats().num_preemptions > 0


def test_prompt_logprobs_cover_tokens_whose_kv_was_cached(tiny_model, hf_logprobs):
    """A request asking for prompt logprobs skips the prefix cache, as vLLM does: every
    prompt position is computed, so every one has its logprobs. A request without them
    still reuses the cache, and its sampled-token logprobs stay exact."""
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [shared + q for q in ("What is AI?", "Name a color.")]
    llm = LLM(tiny_model, dtype="float32", max_model_len=128)
    llm.generate(prompts[:1], params(0), use_tqdm=False)
    hits = llm.stats().prefix_cache_hits
    outs = llm.generate(prompts, [params(1, prompt_logprobs=NUM_LOGPROBS), params(2)],
                        use_tqdm=False)  # fmt: skip
    check_against_hf(outs[0], hf_logprobs)
    check_against_hf(outs[1], hf_logprobs, prompt_logprobs=False)
    assert llm.stats().prefix_cache_hits > hits  # the second request did hit


def test_logprobs_are_the_raw_models_whatever_the_sampling_knobs(tiny_model, hf_logprobs):
    llm = LLM(tiny_model, dtype="float32", max_model_len=128)
    knobs = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.3, top_k=5, top_p=0.9,
                           repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True,
                           logprobs=NUM_LOGPROBS, seed=3)  # fmt: skip
    check_against_hf(llm.generate(PROMPTS[1], knobs, use_tqdm=False)[0], hf_logprobs, False)
