"""The CPU LoRA product in punica's BGMV shape: one C++ call per fused projection adds each
row's own adapter, shrink and expand fused, and skips base-model rows.

slots.py's torch path spends four ops a projection (shrink against every slot, the row
mask, expand, add), 480 a step on a 30-layer model: each is a parallel region, and on a
shared 2-core machine every one waited for a time slice (a profile of `bench lora-tiers`
on the bundled model put 38 % of the run there, more than the base projections). This
kernel is one call, on one thread (a step's adapter rows are microseconds of work), and
computes a row against its own slot only: a rank-R GEMV each way, nothing for rows with
slot -1. Roundings are torch's: h rounded to the model dtype, the delta rounded to it, then
the add rounded; only the order of the float32 sums differs, as a batched GEMM's does.

Built on first use like cpu_norm's kernel; where it cannot be built `load()` returns None
once and the torch path runs."""

import functools

import torch

from batchpilot.server.platform import cpu_kernels

SOURCE = r"""
#include <torch/extension.h>
#include <vector>

// y [n, d_out] += per row r with slot s >= 0: B_s (A_s x_r), modules fused. a: [S, P*R, d_in];
// b: [S, P*R, d_out], row p*R + k nonzero only in module p's columns bounds[p]..bounds[p+1].
// Both float32 (holding values already rounded to the model dtype), so every inner loop is
// a contiguous float32 dot or axpy that the compiler vectorizes.
template <typename T>
static void bgmv_rows(T* y, const T* x, const float* a, const float* b, const int64_t* slots,
                      const std::vector<int64_t>& bounds, int64_t n, int64_t d_in,
                      int64_t d_out, int64_t rank) {
  const int64_t parts = bounds.size() - 1, pr = parts * rank;
  std::vector<float> xf(d_in), h(pr), acc(d_out);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t s = slots[r];
    if (s < 0) continue;  // a base-model row: nothing to add
    for (int64_t i = 0; i < d_in; ++i) xf[i] = static_cast<float>(x[r * d_in + i]);
    const float* as = a + s * pr * d_in;
    for (int64_t k = 0; k < pr; ++k) {
      const float* ak = as + k * d_in;
      float dot = 0.f;
      for (int64_t i = 0; i < d_in; ++i) dot += ak[i] * xf[i];
      h[k] = static_cast<float>(static_cast<T>(dot));  // rounded as a matmul's output
    }
    const float* bs = b + s * pr * d_out;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t lo = bounds[p], hi = bounds[p + 1];
      for (int64_t j = lo; j < hi; ++j) acc[j] = 0.f;
      for (int64_t k = p * rank; k < (p + 1) * rank; ++k) {
        const float hk = h[k];
        const float* bk = bs + k * d_out;
        for (int64_t j = lo; j < hi; ++j) acc[j] += hk * bk[j];
      }
    }
    T* yr = y + r * d_out;
    for (int64_t j = 0; j < d_out; ++j)
      yr[j] = static_cast<T>(static_cast<float>(yr[j]) + static_cast<float>(static_cast<T>(acc[j])));
  }
}

void lora_bgmv(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b,
               torch::Tensor slots, std::vector<int64_t> bounds, int64_t rank) {
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && a.is_contiguous() &&
              b.is_contiguous() && slots.is_contiguous(), "dense tensors only");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == at::kFloat &&
              b.scalar_type() == at::kFloat, "x and y in one dtype, a and b float32");
  const int64_t n = y.size(0), d_out = y.size(1);
  TORCH_CHECK(x.size(0) == n && slots.numel() == n && b.size(2) == d_out &&
              bounds.back() == d_out && a.size(1) == (int64_t)(bounds.size() - 1) * rank &&
              b.size(1) == a.size(1), "shapes");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_bgmv", [&] {
    bgmv_rows<scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), a.data_ptr<float>(),
                        b.data_ptr<float>(), slots.data_ptr<int64_t>(), bounds, n, x.size(1),
                        d_out, rank);
  });
}
"""

# -fassociative-math lets the compiler vectorize the float32 sums (as cpu_norm's).
CFLAGS = ("-O3", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
KERNEL = cpu_kernels.Kernel("cpu_lora", SOURCE, "lora_bgmv", "LoRA", CFLAGS)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def load():
    """The compiled module, or None where it cannot be built."""
    return cpu_kernels.build(KERNEL)


def usable(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in DTYPES and load() is not None
