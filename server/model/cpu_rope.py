"""Rotary embedding and the K/V cache write fused into one C++ pass, for CPU models.

Per layer, torch spends nine op dispatches here (two multiplies, a roll, an add, two
transposes, two index copies, a view), each costing more than its arithmetic at one
decoding sequence. This kernel rotates q and k in place in the projection's output and
writes k and v at their slots, with torch's roundings: x * cos and the swapped halves
times the signed sin each rounded to the model dtype, then their sum rounded (float32:
no fused multiply-add, -ffp-contract=off), so greedy output stays token for token.

K/V caches in the model dtype only: an fp8 cache quantizes on write (kv/cache.py) and
keeps the torch path, as does any device but the CPU. Built on first use like the other
CPU kernels; where it cannot be built `load()` returns None once and torch's ops run."""

import functools

import torch

from batchpilot.server.attention.metadata import AttentionMetadata
from batchpilot.server.kv.cache import KVCache
from batchpilot.server.platform import cpu_kernels

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

// One head in place: x * cos + roll(x, d / 2) * sin, each product and the sum rounded to T.
template <typename T>
static inline void rotate(T* x, const T* c, const T* s, int64_t d, float* old) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) old[i] = static_cast<float>(x[i]);
  for (int64_t i = 0; i < d; ++i) {
    const float a = static_cast<float>(static_cast<T>(old[i] * static_cast<float>(c[i])));
    const float swapped = old[i < half ? i + half : i - half];
    const float b = static_cast<float>(static_cast<T>(swapped * static_cast<float>(s[i])));
    x[i] = static_cast<T>(a + b);
  }
}

// qk: [n, heads + kv_heads, d] (rows strided, heads dense), rotated in place; v: [n, kv_heads,
// d]; cos, sin: [n, 1, d] dense; k_cache, v_cache: [kv_heads, slots, d] dense; slots: [n]
// (a negative slot is padding: not written).
void rope_and_cache(torch::Tensor qk, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                    int64_t heads) {
  const int64_t n = qk.size(0), all_heads = qk.size(1), d = qk.size(2);
  const int64_t kv_heads = all_heads - heads, cache_len = k_cache.size(1);
  const int64_t qk_row = qk.stride(0), qk_head = qk.stride(1);
  const int64_t v_row = v.stride(0), v_head = v.stride(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rope", [&] {
    scalar_t* q = qk.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    // Tokens split across threads only for prefill-sized steps: a decode step's rows are
    // microseconds, less than waking a thread costs.
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> old(d);
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* row = q + t * qk_row;
        for (int64_t h = 0; h < all_heads; ++h)
          rotate<scalar_t>(row + h * qk_head, c + t * d, s + t * d, d, old.data());
        if (slot[t] < 0) continue;
        for (int64_t g = 0; g < kv_heads; ++g) {
          const int64_t at = (g * cache_len + slot[t]) * d;
          std::copy_n(row + (heads + g) * qk_head, d, kc + at);
          std::copy_n(vp + t * v_row + g * v_head, d, vc + at);
        }
      }
    });
  });
}
"""

# -ffp-contract=off: GCC would otherwise fuse float32's a + b products into an FMA and round
# differently from torch's separate multiply and add.
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
KERNEL = cpu_kernels.Kernel("cpu_rope", SOURCE, "rope_and_cache", "rotary + KV write", CFLAGS,
                           ("-fopenmp",))  # fmt: skip
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def load():
    """The compiled module, or None where it cannot be built."""
    return cpu_kernels.build(KERNEL)


def usable(qk: torch.Tensor, kv: KVCache, meta) -> bool:
    """CPU tensors, a cache in the model dtype, the shapes the kernel indexes, and the torch
    attention path (Triton's, interpreted on a CPU in tests, writes its own K/V)."""
    return (isinstance(meta, AttentionMetadata) and qk.device.type == "cpu"
            and qk.dtype in DTYPES and kv.raw_dtype == qk.dtype
            and qk.stride(-1) == 1 and qk.stride(1) == qk.shape[-1]
            and load() is not None)  # fmt: skip


def rope_and_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv: KVCache, layer: int, slots: torch.Tensor, heads: int) -> None:  # fmt: skip
    """qk: [tokens, heads + kv_heads, dim], rotated in place; v: [tokens, kv_heads, dim];
    k (qk's last kv_heads) and v written to `layer` of the cache at `slots`."""
    v = v if v.stride(-1) == 1 and v.stride(1) == v.shape[-1] else v.contiguous()
    load().rope_and_cache(qk, v, cos.contiguous(), sin.contiguous(), kv.k[layer], kv.v[layer],
                          slots, heads)  # fmt: skip
