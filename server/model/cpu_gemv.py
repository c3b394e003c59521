"""bfloat16 projections for decode-sized row counts on CPUs with AVX512-BF16.

A decode step of one sequence multiplies one row by every weight once, so its speed is
the speed at which the weights stream from memory. On a 2-core AMD EPYC whose streaming
reads peak near 21 GB/s, torch's bf16 `F.linear` read the bundled model's weights at
about 15.5 GB/s at one row and at a fifteenth of that at two rows (a slow oneDNN path);
this kernel reads them at about 17 GB/s at one row and stays ahead of torch up to 16
rows. It streams four weight rows at a time through `vdpbf16ps` (products exact in float32,
float32 sums, one rounding to bf16 at the end, as oneDNN's bf16 matmul does), every
block of up to four input rows reusing the weight rows from L1. Past GEMV_MAX_ROWS rows
the work is compute-bound and a GEMM is faster: oneDNN's on a prepacked copy of the
weights while that copy is small (PACKED_COPY_MAX_BYTES), else torch's F.linear.

Built on first use like cpu_decode's kernel; where it cannot be built `load()` returns
None once and torch's linear stays."""

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from batchpilot.server.model import cpu_linear
from batchpilot.server.platform import cpu_kernels
from batchpilot.server.platform.cpuinfo import cpu_flags

log = logging.getLogger("batchpilot.engine")

# Timed over the bundled model's weights, cold, 2 threads: the kernel ahead of torch at 1
# to 16 rows (16.1 against 17.4 ms at one, 17 against 261 at two, 23 against 26 at eight,
# 28 against 30 at 16), far behind at 40; with the weights in cache, behind from 16 rows.
GEMV_MAX_ROWS = 8
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Above GEMV_MAX_ROWS oneDNN's linear on a prepacked copy of the weights ran a 40-sequence
# step in 86 ms against torch's 103 (the bundled model), at the cost of that copy: kept
# only while it stays this small.
PACKED_COPY_MAX_BYTES = 1 << 30

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// One core keeps too few cache misses in flight to stream at the memory's speed: asking the
// L2 for the weights 8 KiB ahead (past the end is harmless: prefetches do not fault) took
// the bundled model's projections from 34 to 24 ms at one thread on an Intel Xeon (AMX).
constexpr int64_t PREFETCH_BYTES = 8192;

// ROWS input rows (x, stride k) against four weight rows w[n..n+3] (stride k).
template <int ROWS>
static inline void tile(const at::BFloat16* x, const at::BFloat16* w, const float* bias,
                        at::BFloat16* y, int64_t k, int64_t n, int64_t out) {
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + j) * k + i) + PREFETCH_BYTES,
                   _MM_HINT_T1);
      wv[j] = (__m512bh)_mm512_loadu_si512(w + (n + j) * k + i);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + i);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) {
      const float b = bias ? bias[n + j] : 0.0f;
      y[r * out + n + j] = at::BFloat16(_mm512_reduce_add_ps(acc[r][j]) + b);
    }
}

static void rows(const at::BFloat16* x, const at::BFloat16* w, const float* bias,
                 at::BFloat16* y, int64_t m, int64_t k, int64_t out, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) tile<4>(x + r * k, w, bias, y + r * out, k, n, out);
  switch (m - r) {
    case 3: tile<3>(x + r * k, w, bias, y + r * out, k, n, out); break;
    case 2: tile<2>(x + r * k, w, bias, y + r * out, k, n, out); break;
    case 1: tile<1>(x + r * k, w, bias, y + r * out, k, n, out); break;
  }
}

// Tiles [begin, end) of four weight rows each of y = x w^T + bias: one thread's share.
// x: [m, k] bf16, contiguous; w: [n, k] bf16, n % 4 == 0, k % 32 == 0; bias: [n] float32 or
// empty; y: [m, n] bf16.
static void gemv_tiles(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                       torch::Tensor& y, int64_t begin, int64_t end) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  for (int64_t t = begin; t < end; ++t) rows(xp, wp, b, yp, m, k, n, t * 4);
}

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  x = x.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  // Contiguous ranges of weight rows per thread, so each streams its own part once.
  at::parallel_for(0, w.size(0) / 4, 16, [&](int64_t begin, int64_t end) {
    gemv_tiles(x, w, bias, y, begin, end);
  });
  return y;
}
"""

# -fopenmp: at::parallel_for splits work across threads only when built with OpenMP.
# Its only target: AVX-512 with AVX512-BF16 (cpu_kernels.BF16).
CFLAGS = ("-O3", "-fopenmp")
KERNEL = cpu_kernels.Kernel("cpu_gemv", SOURCE, "gemv_bf16", "bf16 GEMV", CFLAGS, ("-fopenmp",),
                            cpu_kernels.BF16)  # fmt: skip


@functools.cache
def load():
    """The compiled module, or None where this CPU lacks AVX512-BF16 or the build fails."""
    if "avx512_bf16" not in cpu_flags():
        return None
    return cpu_kernels.build(KERNEL)


def fits(linear: nn.Linear) -> bool:
    """The kernel's shapes: bf16 weights, whole 32-wide K steps, whole 4-row tiles."""
    out_features, in_features = linear.weight.shape
    return (linear.weight.dtype == torch.bfloat16 and in_features % 32 == 0
            and out_features % 4 == 0)  # fmt: skip


def apply(model, requested: str) -> str | None:
    """Under linear_backend auto, for a bf16 model where the kernel builds: swap the
    decoder layers' projections and the lm_head (tied or not: the module keeps the same
    weight tensor) to GemvLinear where their shapes fit -> "gemv". Else None, changing
    nothing: cpu_linear decides."""
    if requested != "auto" or model.lm_head.weight.dtype != torch.bfloat16 or load() is None:
        return None
    linears = [(layer, name) for layer in model.layers for name in PROJECTIONS]
    linears = [(m, name) for m, name in [*linears, (model, "lm_head")] if fits(getattr(m, name))]
    size = sum(getattr(m, name).weight.nbytes for m, name in linears)
    packed = size <= PACKED_COPY_MAX_BYTES and torch.backends.mkldnn.is_available()
    log.info("CPU linear: bf16 GEMV kernel up to %d rows, %s above", GEMV_MAX_ROWS,
             f"oneDNN prepacked (a {size / 2**20:.0f} MiB copy)" if packed else "torch")  # fmt: skip
    for m, name in linears:
        setattr(m, name, GemvLinear(getattr(m, name), packed))
    return "gemv"


class GemvLinear(nn.Module):
    """nn.Linear's forward on the same (dense, possibly tied) weight: the kernel up to
    GEMV_MAX_ROWS rows; above, oneDNN's linear on a prepacked copy (packed) or torch's."""

    def __init__(self, linear: nn.Linear, packed: bool):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = linear.bias.detach().float() if linear.bias is not None else torch.empty(0)
        self.register_buffer("bias_f32", bias, persistent=False)
        self.packed = cpu_linear.pack(linear.weight.detach()) if packed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > GEMV_MAX_ROWS or x.dtype != torch.bfloat16:
            if self.packed is None or x.dtype != torch.bfloat16:
                return F.linear(x, self.weight, self.bias)
            return cpu_linear.prepacked_linear(x, self.packed, self.bias)
        y = load().gemv_bf16(x.reshape(rows, self.in_features), self.weight, self.bias_f32)
        return y.view(*x.shape[:-1], self.out_features)
