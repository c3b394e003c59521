"""The engine on the Triton attention backend, on CPU through Triton's interpreter:
greedy tokens equal transformers generate() with prompts prefilled in 16-token chunks
(most chunks attend to a cached prefix, decodes batch with chunks), and an fp8 KV cache
runs the same path. Swapping is the KV cache's own code, the same on either backend,
and is covered by test_equivalence."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined: run on CPU

from batchpilot.server import LLM, SamplingParams
from tests.support.engine import PROMPTS

MAX_TOKENS = 8
CHUNKED = dict(max_model_len=128, max_num_batched_tokens=16, attention_backend="triton")
LONG_PROMPTS = [PROMPTS[3], PROMPTS[6], PROMPTS[2], PROMPTS[5]]  # 53, 53, 17, 17 tokens
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_triton_backend_matches_transformers(tiny_model, hf_greedy):
    llm = LLM(tiny_model, dtype="float32", **CHUNKED)
    assert llm.engine.runner.attention_backend == "triton"
    for out in llm.generate(LONG_PROMPTS, PARAMS, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(out.prompt_token_ids, MAX_TOKENS)
    stats = llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_triton_backend_with_fp8_kv(tiny_model):
    llm = LLM(tiny_model, dtype="float32", kv_cache_dtype="fp8", **CHUNKED)
    outs = llm.generate(LONG_PROMPTS[:2], PARAMS, use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == MAX_TOKENS for out in outs)
    assert llm.engine.runner.kv_cache.k.dtype.itemsize == 1
