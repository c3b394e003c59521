"""Two calibrations of one replica: this CPU running the bundled model, and a GPU-shaped
profile of a Llama-3-8B-class model on one H100 80GB.

A step takes ``step_base_s + step_per_seq_s x decodes + step_per_context_token_s x the
decoding sequences' context + prefill_per_token_s x prefill tokens`` (times a noisy
neighbour's factor, when one strikes). What differs between the two is the shape: on the
CPU every sequence in the batch costs a visible share of the step, on the GPU a decode
step reads the weights once whatever the batch, so it is nearly flat in batch size until
the KV cache runs out.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.loopsim.operator_api import is_fp8

GiB = 1 << 30


@dataclass(frozen=True)
class EngineModel:
    """This CPU's figures by default: the engine benchmark on the bundled
    SmolLM2-135M-Instruct, bfloat16, 2 CPU cores (benchmarks/HISTORY.md, results/*.json).

    - step time = 40.8 ms + 2.55 ms per sequence + 2.3 µs per context token + 0.8 ms per
      prefill token. The first two are a least-squares fit of the online sweep's TPOT P50
      at 2, 8 and 32 concurrent streams (41.2, 70.8, 132.2 ms; prompts 118 tokens on
      average); the context term is the decode profile's attention share (29% of 116 ms at
      32 x 458 context tokens); the prefill term lies between the sweep's TTFT at 2 streams
      ((108 - 41) ms / 118 tokens) and the interference run's 1,600-token prompt (1.2 ms a
      token).
    - KV block = 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 16 tokens x the element
      size: 368,640 bytes in bfloat16, half that in fp8 (``kv_cache_dtype``).
    - a swap moves a sequence's blocks at 8 GB/s, the profile's bandwidth for weights that
      miss the cache.
    """

    step_base_s: float = 0.0408
    step_per_seq_s: float = 0.00255
    step_per_context_token_s: float = 2.3e-6
    prefill_per_token_s: float = 0.0008
    block_size: int = 16
    bytes_per_block_16bit: int = 368_640
    swap_bytes_per_s: float = 8e9
    # A plant's extras (benchmarks/loopsim/SCHEMA.md), off in both calibrations above: a
    # superlinear batch term (x decodes squared) and CUDA-graph capture sizes, to which a
    # decode batch is padded up (a batch above the largest runs unpadded).
    step_per_seq_sq_s: float = 0.0
    graph_sizes: tuple[int, ...] = ()

    def step_seconds(self, decodes: int, context_tokens: int, prefill_tokens: int) -> float:
        """One step's compute: ``decodes`` decoding sequences holding ``context_tokens`` in
        all, plus ``prefill_tokens`` of prompt chunks (swaps and noise are the caller's)."""
        batch = decodes
        if self.graph_sizes and decodes:
            batch = next((g for g in self.graph_sizes if g >= decodes), decodes)
        seconds = (
            self.step_base_s
            + self.step_per_seq_s * batch
            + self.step_per_context_token_s * context_tokens
            + self.prefill_per_token_s * prefill_tokens
        )
        if self.step_per_seq_sq_s:
            seconds += self.step_per_seq_sq_s * batch * batch
        return seconds

    def block_bytes(self, kv_cache_dtype: str) -> int:
        return self.bytes_per_block_16bit // (2 if is_fp8(kv_cache_dtype) else 1)


@dataclass(frozen=True)
class Calibration:
    name: str
    model: EngineModel
    kv_cache_bytes: int
    swap_space_bytes: int
    # The server's step budget when spec.engine leaves it unset (server/config.py).
    default_budget: int


CPU = Calibration(
    "cpu", EngineModel(), kv_cache_bytes=1 * GiB, swap_space_bytes=4 * GiB, default_budget=512
)

# Llama-3-8B in bfloat16 on one H100 80GB (HBM3, 3.35 TB/s; 989 dense bf16 TFLOP/s).
# KV per token: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 131,072 B, so a
# 16-token block is 2 MiB. KV cache: 0.9 x 80 GB (gpu_memory_utilization) - 16 GB of
# weights = 56 GB, 427,000 tokens.
#
# Step time, from published vLLM figures (no stored page had an H100 ITL-per-concurrency
# table for this model, so the terms are scaled from these by memory bandwidth):
# - base 6.5 ms: a decode step reads the 16 GB of weights once. vLLM's CI measures
#   Llama-3.1-8B with batch 8, 32 prompt + 128 output tokens at 833 ms end to end on an
#   H200 (https://buildkite.com/vllm/performance-benchmark/builds/9515): 6.5 ms a token
#   at 4.8 TB/s. A single A100-40GB stream of the same model runs at 75 tokens/s, 77% of
#   its 1.56 TB/s roofline (https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on);
#   77% of the H100's 3.35 TB/s gives 6.2 ms.
# - 30 µs per decoding sequence: 16 GFLOP a token at about half the dense peak.
# - 50 ns per context token: 131,072 B of KV read at 77% of 3.35 TB/s.
# - 35 µs per prefill token: the same 16 GFLOP a token at about 45% of peak (prefill is
#   compute-bound).
# So 64 sequences of 600 context tokens decode in about 10 ms, 256 in about 22 ms.
# - swaps at 25 GB/s (PCIe Gen5 x16, one way, in practice).
H100_LLAMA3_8B = Calibration(
    "h100-llama3-8b",
    EngineModel(
        step_base_s=0.0065,
        step_per_seq_s=30e-6,
        step_per_context_token_s=50e-9,
        prefill_per_token_s=35e-6,
        block_size=16,
        bytes_per_block_16bit=16 * 131_072,
        swap_bytes_per_s=25e9,
    ),
    kv_cache_bytes=int(0.9 * 80e9 - 16e9),
    swap_space_bytes=4 * GiB,
    default_budget=2048,
)

CALIBRATIONS = {c.name: c for c in (CPU, H100_LLAMA3_8B)}
