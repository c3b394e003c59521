"""Greedy tokens from the engine equal transformers generate() token for token, under
batching, chunked prefill, forced preemption (swap and recompute) and prefix hits."""

import pytest

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.kv import manager
from tests.support.engine import CONDITIONS, PROMPTS

MAX_TOKENS = 24


def run(model, prompts, **config):
    llm = LLM(model, dtype="float32", max_model_len=128, **config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_greedy_matches_transformers(tiny_model, hf_greedy, condition):
    llm, outs = run(tiny_model, PROMPTS, **CONDITIONS[condition])
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(out.prompt_token_ids, MAX_TOKENS)
        assert out.outputs[0].finish_reason == "length"
    stats = llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    if condition.startswith("preempt"):
        assert stats.num_preemptions > 0
    if condition == "preempt_swap":
        assert stats.num_swaps_out > 0 and stats.num_swaps_in == stats.num_swaps_out
    if condition == "preempt_recompute":
        assert stats.num_swaps_out == 0


def test_prefix_cache_hits_keep_outputs_identical(tiny_model, hf_greedy):
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [shared + q for q in ("What is AI?", "Name a color.", "Count to three.")]
    llm, first = run(tiny_model, prompts[:1])
    hits_before = llm.stats().prefix_cache_hits
    second = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                  ignore_eos=True), use_tqdm=False)  # fmt: skip
    shared_blocks = len(llm.get_tokenizer()(shared)["input_ids"]) // 16
    assert hits_before == 0
    # The repeated prompt hits all its full blocks but one; the others hit the shared ones.
    assert llm.stats().prefix_cache_hits >= 16 * (3 * shared_blocks - 1)
    assert llm.engine.scheduler.counters.num_preemptions == 0
    assert second[0].num_cached_tokens >= 16 * shared_blocks  # as vLLM reports it
    for out in first + second:
        assert out.outputs[0].token_ids == hf_greedy(out.prompt_token_ids, MAX_TOKENS)
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids


def test_forced_prefix_key_collisions_change_no_output(tiny_model, hf_greedy, monkeypatch):
    """With every block key equal, a hit still needs equal tokens after an equal parent:
    outputs equal the uncached run token for token."""
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [shared + "What is AI?", "Something else entirely, " * 6, shared + "Name a color."]
    _, uncached = run(tiny_model, prompts, enable_prefix_caching=False)
    monkeypatch.setattr(manager, "block_digest", lambda parent, tokens: b"collision")
    llm, first = run(tiny_model, prompts[:1])
    second = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                  ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert llm.stats().prefix_cache_hits > 0  # the one cached block is reused where it fits
    for out, expected in zip(first + second, uncached[:1] + uncached, strict=True):
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert out.outputs[0].token_ids == hf_greedy(out.prompt_token_ids, MAX_TOKENS)


@pytest.mark.parametrize("budget", [2048, 40])
def test_prompts_admitted_together_share_the_blocks_their_step_fills(tiny_model, hf_greedy,
                                                                     budget):  # fmt: skip
    """A burst of prompts with one prefix (the seed's load script) prefills it once: a
    prompt admitted after another in the same step reads the blocks that step writes. A
    small budget cuts the first prompt's chunk short, and only its computed blocks count."""
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [shared + q for q in ("What is AI?", "Name a color.", "Count to three.")]
    llm, outs = run(tiny_model, prompts, max_num_batched_tokens=budget)
    shared_blocks = len(llm.get_tokenizer()(shared)["input_ids"]) // 16
    assert llm.stats().prefix_cache_hits >= 2 * 16 * shared_blocks
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(out.prompt_token_ids, MAX_TOKENS)
