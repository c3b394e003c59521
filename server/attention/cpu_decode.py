"""CPU decode attention that reads K/V blocks in place through the block table.

The torch path gathers every decoding sequence's blocks into a padded copy per layer
(`KVCache.read`) before two batched matmuls; this kernel walks the block table instead,
with the softmax fused and fp32 accumulation, one (sequence, KV head) per task. It is
compiled on first use with torch.utils.cpp_extension; where that fails (no compiler,
no headers) `load()` returns None once and the torch path runs.

Whether it or torch decodes is measured at start-up: cpu_decode_choice.py."""

import functools

from batchpilot.server.platform import cpu_kernels

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

#ifdef __AVX512F__
#include <immintrin.h>
// 16 bf16 values widened to float32 (exact: a bf16 is a float32's top half).
static inline __m512 bf16x16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// A job's K and V rows lie in blocks scattered by its block table, which the hardware
// prefetcher does not follow across: each row is asked for this many positions ahead (the
// first ones at the job's start), into the L2. A job whose rows came from memory ran 30%
// faster (EPYC, 265 positions, head_dim 64); the arithmetic is unchanged.
constexpr int64_t PREFETCH_POSITIONS = 16;

template <int D>
static inline void prefetch_row(const at::BFloat16* row) {
  for (int b = 0; b < D * 2; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T1);
}

// One (sequence, KV head) of a bf16 cache, its G query heads at once, head_dim 16 * C: each
// K and V row is widened once a position and the G heads' q and accumulators stay in
// registers. The auto-vectorized loop below widened each row once per head and reduced
// every accumulator through memory: 4x this one's time at one thread (EPYC, head_dim 64).
template <int G, int C>
static void bf16_job(const at::BFloat16* qs, const at::BFloat16* kc, const at::BFloat16* vc,
                     const int64_t* slot_of, int64_t len, float scale, float* scores,
                     at::BFloat16* os) {
  constexpr int D = 16 * C;
  __m512 q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      q[g][c] = _mm512_mul_ps(bf16x16(qs + g * D + c * 16), _mm512_set1_ps(scale));
  for (int64_t t = 0; t < std::min(len, PREFETCH_POSITIONS); ++t) {
    prefetch_row<D>(kc + slot_of[t] * D);
    prefetch_row<D>(vc + slot_of[t] * D);
  }
  for (int64_t t = 0; t < len; ++t) {
    if (t + PREFETCH_POSITIONS < len) prefetch_row<D>(kc + slot_of[t + PREFETCH_POSITIONS] * D);
    __m512 k[C];
    for (int c = 0; c < C; ++c) k[c] = bf16x16(kc + slot_of[t] * D + c * 16);
    for (int g = 0; g < G; ++g) {
      __m512 dot = _mm512_mul_ps(q[g][0], k[0]);
      for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(q[g][c], k[c], dot);
      scores[g * len + t] = _mm512_reduce_add_ps(dot);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * len;
    float top = -INFINITY, sum = 0;
    for (int64_t t = 0; t < len; ++t) top = std::max(top, row[t]);
    for (int64_t t = 0; t < len; ++t) row[t] = exp_nonpositive(row[t] - top);
    for (int64_t t = 0; t < len; ++t) sum += row[t];
    for (int64_t t = 0; t < len; ++t) row[t] /= sum;
  }
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    if (t + PREFETCH_POSITIONS < len) prefetch_row<D>(vc + slot_of[t + PREFETCH_POSITIONS] * D);
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = bf16x16(vc + slot_of[t] * D + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * len + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  alignas(64) float out[16];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(out, acc[g][c]);
      for (int i = 0; i < 16; ++i) os[g * D + c * 16 + i] = at::BFloat16(out[i]);
    }
}

using BF16Job = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*,
                         const int64_t*, int64_t, float, float*, at::BFloat16*);

template <int C>
static BF16Job bf16_job_for_group(int64_t group) {
  switch (group) {
    case 1: return bf16_job<1, C>;
    case 2: return bf16_job<2, C>;
    case 3: return bf16_job<3, C>;
    case 4: return bf16_job<4, C>;
    case 5: return bf16_job<5, C>;
    case 6: return bf16_job<6, C>;
    case 7: return bf16_job<7, C>;
    case 8: return bf16_job<8, C>;
    default: return nullptr;
  }
}

// The register-blocked job for this shape, or nullptr (the portable loop serves it).
static BF16Job bf16_job_for(int64_t group, int64_t dim) {
  switch (dim) {
    case 16: return bf16_job_for_group<1>(group);
    case 64: return bf16_job_for_group<4>(group);
    case 128: return bf16_job_for_group<8>(group);
    default: return nullptr;
  }
}
#endif

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
  std::vector<int64_t> slot_of;
#ifdef __AVX512F__
  BF16Job fast = nullptr;
  if constexpr (std::is_same_v<T, at::BFloat16>) fast = bf16_job_for(group, dim);
#endif
  for (int64_t job = begin; job < end; ++job) {
    const int64_t s = job / kv_heads, h = job % kv_heads, len = lens[s];
    const T* qs = q + (s * heads + h * group) * dim;
    // Each position's cache slot, once per task: a 64-bit division per position and
    // pass cost more than the dot products at a few hundred tokens of context.
    slot_of.resize(len);
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
      const int64_t base = tables[s * width + t0 / block_size] * block_size - t0;
      for (int64_t t = t0; t < std::min(len, t0 + block_size); ++t) slot_of[t] = base + t;
    }
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (fast) {  // it writes every score before reading one: no zeroing
        scores.resize(group * len);
        fast(qs, kc + h * slots * dim, vc + h * slots * dim, slot_of.data(), len, scale,
             scores.data(), out + (s * heads + h * group) * dim);
        continue;
      }
    }
#endif
    scores.assign(group * len, acc_t(0));
    for (int64_t i = 0; i < group * dim; ++i) qf[i] = static_cast<acc_t>(qs[i]) * scale;
    for (int64_t t = 0; t < len; ++t) {
      const T* kr = kc + (h * slots + slot_of[t]) * dim;
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
      const T* vr = vc + (h * slots + slot_of[t]) * dim;
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


# -march (native, or a prebuilt target's) vectorizes the float loops, and the
# reassociation flags let the compiler vectorize the dot products' sums. -fopenmp: without it at::parallel_for
# runs every (sequence, KV head) task on one thread.
FAST_SUMS = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
CFLAGS = ("-O3", *FAST_SUMS, "-fopenmp")
KERNEL = cpu_kernels.Kernel("cpu_decode", SOURCE, "paged_decode", "decode attention", CFLAGS,
                            ("-fopenmp",))  # fmt: skip


@functools.cache
def load():
    """The compiled module, or None where it cannot be built."""
    return cpu_kernels.build(KERNEL)


def paged_decode(q, k_cache, v_cache, tables, lens, block_size: int, scale: float):
    """q: [n, heads, dim]; caches [kv_heads, slots, dim]; tables [n, width]; lens [n]."""
    return load().paged_decode(q, k_cache, v_cache, tables, lens, block_size, scale)
