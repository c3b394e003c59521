"""CPU decode attention that reads K/V blocks in place through the block table.

The torch path gathers every decoding sequence's blocks into a padded copy per layer
(`KVCache.read`) before two batched matmuls; this kernel walks the block table instead,
with the softmax fused and fp32 accumulation, one (sequence, KV head) per task. It is
compiled on first use with torch.utils.cpp_extension; where that fails (no compiler,
no headers) `load()` returns None once and the torch path runs.

The kernel does not win everywhere (float32 on an AVX-512 Xeon without AVX512-BF16: 452
against 417 ms per 40-sequence step), so `choose()` times both paths on the model's
shapes when an engine starts and keeps the verdict (server/verdicts.py) beside the
kernel's build, keyed by everything the verdict depends on; later starts read it."""

import functools
import hashlib
import logging
from pathlib import Path

import torch

from batchpilot.server import verdicts

log = logging.getLogger("batchpilot.engine")

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

// exp for x <= 0 in float, branch-free so the compiler vectorizes the softmax loop (libm's
// expf does not vectorize without -ffast-math): 2^n * p(r), relative error about 2e-7.
static inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

static inline double exp_nonpositive(double x) { return std::exp(x); }

template <typename T>
void decode_rows(const T* q, const T* kc, const T* vc, const int64_t* tables,
                 const int64_t* lens, T* out, int64_t heads, int64_t kv_heads, int64_t dim,
                 int64_t slots, int64_t width, int64_t block_size, float scale,
                 int64_t begin, int64_t end) {
  const int64_t group = heads / kv_heads;
  // float32 models accumulate in double: they must stay within 1e-4 of transformers'
  // logprobs, and reassociated float sums drift past that. bf16/fp16 ones round far
  // more than that already, so they keep the faster float accumulators.
  using acc_t = std::conditional_t<std::is_same_v<T, float>, double, float>;
  std::vector<acc_t> qf(group * dim), kf(dim), acc(group * dim), scores;
  for (int64_t job = begin; job < end; ++job) {
    const int64_t s = job / kv_heads, h = job % kv_heads, len = lens[s];
    const T* qs = q + (s * heads + h * group) * dim;
    for (int64_t i = 0; i < group * dim; ++i) qf[i] = static_cast<acc_t>(qs[i]) * scale;
    scores.assign(group * len, acc_t(0));
    for (int64_t t = 0; t < len; ++t) {
      const int64_t slot = tables[s * width + t / block_size] * block_size + t % block_size;
      const T* kr = kc + (h * slots + slot) * dim;
      for (int64_t d = 0; d < dim; ++d) kf[d] = static_cast<acc_t>(kr[d]);
      for (int64_t g = 0; g < group; ++g) {
        acc_t dot = 0;
        for (int64_t d = 0; d < dim; ++d) dot += qf[g * dim + d] * kf[d];
        scores[g * len + t] = dot;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      acc_t* row = scores.data() + g * len;
      acc_t top = -INFINITY, sum = 0;
      for (int64_t t = 0; t < len; ++t) top = std::max(top, row[t]);
      for (int64_t t = 0; t < len; ++t) row[t] = exp_nonpositive(row[t] - top);
      for (int64_t t = 0; t < len; ++t) sum += row[t];
      for (int64_t t = 0; t < len; ++t) row[t] /= sum;
    }
    std::fill(acc.begin(), acc.end(), acc_t(0));
    for (int64_t t = 0; t < len; ++t) {
      const int64_t slot = tables[s * width + t / block_size] * block_size + t % block_size;
      const T* vr = vc + (h * slots + slot) * dim;
      for (int64_t d = 0; d < dim; ++d) kf[d] = static_cast<acc_t>(vr[d]);
      for (int64_t g = 0; g < group; ++g) {
        const acc_t p = scores[g * len + t];
        for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * kf[d];
      }
    }
    T* os = out + (s * heads + h * group) * dim;
    for (int64_t i = 0; i < group * dim; ++i) os[i] = static_cast<T>(static_cast<float>(acc[i]));
  }
}

// q: [n, heads, dim]; k_cache, v_cache: [kv_heads, slots, dim]; tables: [n, width];
// lens: [n] context lengths -> [n, heads * dim]
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, int64_t block_size,
                           double scale) {
  q = q.contiguous();
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), slots = k_cache.size(1), width = tables.size(1);
  auto out = torch::empty({n, heads * dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
      decode_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                            lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), heads,
                            kv_heads, dim, slots, width, block_size, (float)scale, begin, end);
    });
  });
  return out;
}
"""


# -march=native vectorizes the float loops for this CPU, and the reassociation flags let
# the compiler vectorize the dot products' sums.
CFLAGS = ["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


@functools.cache
def load():
    """The compiled module, or None (logged once) where it cannot be built. The build is
    cached by torch under a name that carries this CPU's flags, so a cache shared with
    another kind of CPU never loads code built for instructions it lacks."""
    from torch.utils.cpp_extension import load_inline

    try:
        log.info("building the CPU decode attention kernel (cached after the first time)")
        return load_inline(f"batchpilot_cpu_decode_{verdicts.flags_digest()}", cpp_sources=SOURCE,
                           functions=["paged_decode"], extra_cflags=CFLAGS)  # fmt: skip
    except Exception as exc:  # any build failure: the torch path is always correct
        log.warning("CPU decode attention kernel unavailable, using torch: %s", exc)
        return None


def paged_decode(q, k_cache, v_cache, tables, lens, block_size: int, scale: float):
    """q: [n, heads, dim]; caches [kv_heads, slots, dim]; tables [n, width]; lens [n]."""
    return load().paged_decode(q, k_cache, v_cache, tables, lens, block_size, scale)


def usable(kv, q: torch.Tensor) -> bool:
    """On CPU, with K/V stored in the model dtype (FP8 caches dequantize in torch)."""
    return q.device.type == "cpu" and not kv.is_fp8 and load() is not None


# ---- kernel or torch, chosen by measurement ---------------------------------------------

# The timed batch: decode steps of this many sequences at this context, one layer's call.
TIMED_SEQS, TIMED_CONTEXT = 32, 512
TIMING_BUDGET_S = 1.0  # the interleaved repeats after one warm-up call of each
MIN_REPEATS, MAX_REPEATS = 3, 9


def choose(requested: str, num_heads: int, num_kv_heads: int, head_dim: int,
           dtype: torch.dtype, block_size: int, kv_cache_dtype: str) -> str:  # fmt: skip
    """The CPU decode path of an engine: "cpu_kernel" or "torch". requested is the
    attention_backend knob: torch and cpu_kernel force a path, auto takes the verdict
    cached for these shapes or measures it now."""
    from batchpilot.server.kv.cache import FP8_DTYPES

    if requested == "torch":
        return "torch"
    fp8 = kv_cache_dtype in FP8_DTYPES
    if requested == "cpu_kernel":
        if fp8:
            raise ValueError("attention_backend cpu_kernel reads K/V in the model dtype: an "
                             "fp8 kv_cache_dtype needs torch or auto")  # fmt: skip
        if load() is None:
            raise ValueError("attention_backend cpu_kernel: the CPU decode kernel could not "
                             "be built (see the warning above)")  # fmt: skip
        log.info("CPU decode attention: the kernel (attention_backend=cpu_kernel)")
        return "cpu_kernel"
    if fp8 or load() is None:
        return "torch"
    shapes = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  dtype=str(dtype).removeprefix("torch."), block_size=block_size)  # fmt: skip
    key = verdict_key(shapes)
    path = verdicts.path_for(verdict_dir(), "decode", key)
    verdict, source = verdicts.read(path, key, ("cpu_kernel", "torch")), "cached"
    if verdict is None:
        kernel_ms, torch_ms = time_both(num_heads, num_kv_heads, head_dim, dtype, block_size)
        choice = "cpu_kernel" if kernel_ms < torch_ms else "torch"
        verdict = {"key": key, "choice": choice, "kernel_ms": kernel_ms, "torch_ms": torch_ms}
        source = "measured" if verdicts.write(path, verdict) else "measured, not cached"
    log.info("CPU decode attention: kernel %.2f ms vs torch %.2f ms per layer at %d sequences "
             "x %d tokens (%s); using %s (%s)", verdict["kernel_ms"], verdict["torch_ms"],
             TIMED_SEQS, TIMED_CONTEXT, shapes["dtype"],
             "the kernel" if verdict["choice"] == "cpu_kernel" else "torch", source)  # fmt: skip
    return verdict["choice"]


def verdict_key(shapes: dict) -> str:
    """Everything a verdict depends on: the kernel's code and flags, the CPU, torch, the
    threads it runs on, and the model's attention shapes."""
    code = hashlib.sha256((SOURCE + " ".join(CFLAGS)).encode()).hexdigest()[:12]
    return verdicts.key(code=code, seqs=TIMED_SEQS, context=TIMED_CONTEXT, **shapes)


def verdict_dir() -> Path:
    """The kernel's build directory (torch's extensions cache, one per CPU-flag set)."""
    return Path(load().__file__).parent


@torch.inference_mode()
def time_both(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              block_size: int) -> tuple[float, float]:  # fmt: skip
    """Median ms of one layer's decode attention through the kernel and through torch
    (the engine's own paged_attention, K/V write included), TIMED_SEQS sequences of
    TIMED_CONTEXT tokens on scrambled blocks; calls interleaved so drifting load from
    other processes hits both alike."""
    from batchpilot.server.attention.metadata import build_metadata
    from batchpilot.server.attention.paged import paged_attention
    from batchpilot.server.kv.cache import KVCache

    cpu = torch.device("cpu")
    per_seq = -(-TIMED_CONTEXT // block_size)
    num_blocks = TIMED_SEQS * per_seq
    kv = KVCache(1, num_blocks, 0, block_size, num_kv_heads, head_dim, dtype, "auto", cpu)
    gen = torch.Generator().manual_seed(0)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    order = torch.randperm(num_blocks, generator=gen).view(TIMED_SEQS, per_seq).tolist()
    seqs = [(table, TIMED_CONTEXT - 1, 1) for table in order]
    q = torch.randn(TIMED_SEQS, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(TIMED_SEQS, num_kv_heads, head_dim, generator=gen).to(dtype)
    metas = {kernel: build_metadata(seqs, TIMED_SEQS, block_size, dtype, cpu, kernel)
             for kernel in (True, False)}  # fmt: skip

    def run(kernel: bool) -> None:
        paged_attention(q, k, k, kv, 0, metas[kernel], head_dim**-0.5)

    return verdicts.time_both(run, TIMING_BUDGET_S, MIN_REPEATS, MAX_REPEATS)
