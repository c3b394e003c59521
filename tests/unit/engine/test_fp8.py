"""FP8 KV cache: capacity for a fixed budget, and round-trip accuracy."""

import torch

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.kv.cache import KVCache


def test_fp8_holds_twice_bf16_and_four_times_fp32_blocks(tiny_model):
    budget = 8 << 20
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"),
                      ("bfloat16", "fp8_e5m2")):  # fmt: skip
        llm = LLM(tiny_model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=budget,
                  max_model_len=128, swap_space_bytes=0)  # fmt: skip
        blocks[dtype, kv] = llm.stats().num_kv_blocks
    assert blocks["bfloat16", "auto"] == 2 * blocks["float32", "auto"]
    assert blocks["float32", "fp8"] == 2 * blocks["bfloat16", "auto"]
    assert blocks["bfloat16", "fp8_e5m2"] == 4 * blocks["float32", "auto"]


def test_fp8_round_trip_keeps_relative_error_small():
    torch.manual_seed(0)
    kv = KVCache(1, 4, 0, 4, 2, 8, torch.float32, "fp8", torch.device("cpu"))
    k, v = torch.randn(16, 2, 8), torch.randn(16, 2, 8) * 0.01  # per-head scales matter
    kv.calibrating = True
    kv.write(0, torch.arange(16), k, v)
    kv.finish_calibration()
    kv.write(0, torch.arange(16), k, v)
    rk, rv = kv.read(0, torch.arange(4)[None, :])
    rk, rv = rk[:, 0].transpose(0, 1), rv[:, 0].transpose(0, 1)
    assert kv.k.dtype == torch.uint8 and kv.k.element_size() == 1
    assert ((rk - k).norm() / k.norm()) < 0.05
    assert ((rv - v).norm() / v.norm()) < 0.05


def test_fp8_engine_runs_swap_and_prefix_paths(tiny_model):
    llm = LLM(
        tiny_model,
        dtype="float32",
        kv_cache_dtype="fp8",
        max_model_len=128,
        kv_cache_memory_bytes=12 * 2 * 2 * 16 * 2 * 16,
    )  # 12 fp8 blocks
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = ["shared prefix " * 20 + str(i) for i in range(8)]
    llm.generate(prompts[:1], params, use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
