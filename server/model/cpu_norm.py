"""RMSNorm with the residual add fused in, one C++ pass per row, for CPU models.

Each decoder layer normalizes twice, and torch's RMSNorm is nine small ops (cast, square,
mean, add, rsqrt, multiply, cast, weight multiply) plus the residual add: at one decoding
sequence, most of a step's 600 norm-related op dispatches cost more than their
arithmetic. This kernel does the add and the norm in one call with torch's roundings: the
sum rounded to the model dtype, float32 statistics, the normalized row rounded to the
model dtype before the weight multiplies it (Gemma: times 1 + weight in float32, then
rounded). Only the order of the squares' sum differs, as a batched GEMM's does.

Built on first use like cpu_decode's kernel; where it cannot be built `load()` returns
None once and the torch ops run."""

import functools

import torch

from batchpilot.server.platform import cpu_kernels

SOURCE = r"""
#include <torch/extension.h>
#include <cmath>

template <typename T>
static void norm_rows(const T* x, const T* res, const T* w, T* sum_out, T* out, int64_t d,
                      float eps, bool offset, int64_t rows) {
  // float32 rows sum their squares in double (like cpu_decode's accumulators).
  using acc_t = std::conditional_t<std::is_same_v<T, float>, double, float>;
  std::vector<float> row(d);
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    acc_t sq = 0;
    for (int64_t i = 0; i < d; ++i) {
      T s = res ? static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(res[r * d + i]))
                : xr[i];
      if (res) sum_out[r * d + i] = s;
      row[i] = static_cast<float>(s);
      sq += static_cast<acc_t>(row[i]) * row[i];
    }
    const float var = static_cast<float>(sq / d);
    const float inv = 1.0f / std::sqrt(var + eps);
    T* o = out + r * d;
    for (int64_t i = 0; i < d; ++i) {
      const float n = row[i] * inv;
      o[i] = offset ? static_cast<T>(n * (1.0f + static_cast<float>(w[i])))
                    : static_cast<T>(static_cast<float>(w[i]) *
                                     static_cast<float>(static_cast<T>(n)));
    }
  }
}

// x, residual (or empty): [n, d]; weight: [d] -> {normalized, x + residual (or empty)}
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                        torch::Tensor weight, double eps, bool offset) {
  x = x.contiguous();
  const bool add = residual.numel() > 0;
  if (add) residual = residual.contiguous();
  const int64_t d = x.size(-1), n = x.numel() / d;
  auto out = torch::empty_like(x);
  auto sum = add ? torch::empty_like(x) : torch::empty({0}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* res = add ? residual.data_ptr<scalar_t>() : nullptr;
    scalar_t* s = add ? sum.data_ptr<scalar_t>() : nullptr;
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), res, weight.data_ptr<scalar_t>(), s,
                        out.data_ptr<scalar_t>(), d, (float)eps, offset, n);
  });
  return {out, sum};
}
"""

# -fassociative-math lets the compiler vectorize the squares' sum. One thread: a step's
# rows are microseconds of work, less than waking a second thread costs, and on a shared
# machine every parallel region waits for its slowest thread.
CFLAGS = ("-O3", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
KERNEL = cpu_kernels.Kernel("cpu_norm", SOURCE, "add_rms_norm", "RMSNorm", CFLAGS)


@functools.cache
def load():
    """The compiled module, or None where it cannot be built."""
    return cpu_kernels.build(KERNEL)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in DTYPES and weight.dtype == x.dtype
            and load() is not None)  # fmt: skip


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, offset: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """-> (RMSNorm of x + residual, x + residual); without a residual, of x and x."""
    empty = x.new_empty(0)
    out, total = load().add_rms_norm(x, empty if residual is None else residual, weight, eps,
                                     offset)  # fmt: skip
    return out, (x if residual is None else total)
