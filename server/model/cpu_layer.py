"""The CPU's small decode steps' layers in one C++ call: the fused decode step.

At one decoding sequence a bf16 layer's kernels (two norms, four GEMVs, the rotary and
K/V write, the attention) run in about 280 µs on a 2-core EPYC, most of it the weights
streaming. Called one by one they left the second thread idle a third of the step: each
kernel forks and joins its own parallel region, and the Python and torch dispatch between
them (about 70 µs a layer) runs on one thread. For a decode-only step of up to
GEMV_MAX_ROWS sequences, with no adapter rows, this runs all the layers in one call into a
module that holds the same four kernels (cpu_norm, cpu_gemv, cpu_rope, cpu_decode: their
sources compiled together here), inside one parallel region, called in the same order on
the same tensors, so the step's logits are the same bit for bit as the layer-by-layer
path's (tests/unit/engine/test_cpu_layer.py).

It serves bf16 Llama-family models whose projections took cpu_gemv's kernel and whose
norms and MLP are plain Llama's (not Gemma's offset norm or GELU, not Qwen3's q/k norms),
with a cache in the model dtype. Anything else, and every prefill, runs the model's own
forward. Where the module cannot be built `load()` returns None once and nothing changes."""

import functools
import re

import torch

from batchpilot.server.attention import cpu_decode
from batchpilot.server.attention.metadata import AttentionMetadata
from batchpilot.server.kv.cache import KVCache
from batchpilot.server.model import cpu_gemv, cpu_norm, cpu_rope
from batchpilot.server.platform import cpu_kernels


def _region(namespace: str, kernel) -> str:
    """A kernel module's source in its own namespace, its #includes hoisted (they must not
    land in a namespace)."""
    body = re.sub(r"^#include .*$", "", kernel.SOURCE, flags=re.MULTILINE)
    return f"namespace {namespace} {{\n{body}\n}}\n"


KERNELS = {"norm": cpu_norm, "gemv": cpu_gemv, "rope": cpu_rope, "decode": cpu_decode}
INCLUDES = sorted(set(re.findall(r"^#include .*$", "".join(m.SOURCE for m in KERNELS.values()),
                                 flags=re.MULTILINE)))  # fmt: skip

LAYER = r"""
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/ParallelGuard.h>
#include <omp.h>

// [begin, end) of `total` tasks for thread `tid` of `threads`: even contiguous shares.
static std::pair<int64_t, int64_t> share(int64_t total, int64_t tid, int64_t threads) {
  const int64_t chunk = (total + threads - 1) / threads;
  return {std::min(total, tid * chunk), std::min(total, (tid + 1) * chunk)};
}

constexpr int64_t LAYER_TENSORS = 10;  // _weights' list, per layer

// x: [n, hidden], the embeddings; w: per layer (LAYER_TENSORS each) its input norm, qkv, its
// float32 bias (or empty), o, bias, post-attention norm, gate_up, bias, down, bias; caches:
// [layers, kv_heads, slots, dim] -> {the last layer's MLP output, its residual}: LlamaDecoder's
// layers, kernel for kernel, in one parallel region. Every thread runs every layer: it takes
// its share of each GEMV's weight rows and of the attention's (sequence, KV head) tasks, and
// computes the norms and the SwiGLU of the step's few rows itself (microseconds of work,
// less than a barrier to share them; the same bits in every thread). Only the rotary and
// K/V write runs on one thread. Six barriers a layer where the layer-by-layer path forks and
// joins five parallel regions, and no Python between the layers.
std::vector<torch::Tensor> decode_step(torch::Tensor x, std::vector<torch::Tensor> w,
                                       torch::Tensor cos, torch::Tensor sin,
                                       torch::Tensor k_caches, torch::Tensor v_caches,
                                       torch::Tensor slots, torch::Tensor tables,
                                       torch::Tensor lens, int64_t heads, int64_t block_size,
                                       double scale, double eps) {
  const int64_t n = x.size(0), layers = k_caches.size(0), kv_heads = k_caches.size(1);
  const int64_t slots_per_head = k_caches.size(2), dim = k_caches.size(3);
  const int64_t qk_width = (heads + kv_heads) * dim, inter = w[6].size(0) / 2;
  // Shared outputs, each written in one phase and read in the next (a barrier between).
  auto qkv = torch::empty({n, w[1].size(0)}, x.options());
  auto attn = torch::empty({n, heads * dim}, x.options());
  auto o = torch::empty({n, w[3].size(0)}, x.options());
  auto gate_up = torch::empty({n, w[6].size(0)}, x.options());
  auto down = torch::empty({n, w[8].size(0)}, x.options());
  auto qk = qkv.narrow(1, 0, qk_width).view({n, heads + kv_heads, dim});
  auto v = qkv.narrow(1, qk_width, kv_heads * dim).view({n, kv_heads, dim});
  torch::Tensor q, residual;
  // The thread count torch was set to in this thread, as at::parallel_for reads it (a thread
  // of the server's other than the one that set it would otherwise run every CPU's worth);
  // no num_threads clause, for the reason ATen gives (GOMP's thread pool).
  at::internal::lazy_init_num_threads();
#pragma omp parallel
  {
    c10::InferenceMode mode;  // the caller's mode, in the workers too
    c10::ParallelGuard nested(true);  // torch ops called here run on the calling thread
    const int64_t tid = omp_get_thread_num(), threads = omp_get_num_threads();
    auto gemv = [&](const torch::Tensor& in, int64_t i, torch::Tensor& out) {
      auto [begin, end] = share(w[i].size(0) / 4, tid, threads);
      gemv::gemv_tiles(in, w[i], w[i + 1], out, begin, end);
    };
    torch::Tensor own_residual = torch::empty({0}, x.options()), input = x;
    for (int64_t l = 0; l < layers; ++l) {
      const torch::Tensor* lw = w.data() + l * LAYER_TENSORS;
      auto normed = norm::add_rms_norm(input, own_residual, lw[0], eps, false);
      if (own_residual.numel() == 0) normed[1] = input;
      gemv(normed[0], l * LAYER_TENSORS + 1, qkv);
#pragma omp barrier
#pragma omp single
      {
        rope::rope_and_cache(qk, v, cos, sin, k_caches[l], v_caches[l], slots, heads);
        q = qk.narrow(1, 0, heads).contiguous();
      }
      auto [first, last] = share(n * kv_heads, tid, threads);
      decode::decode_rows<at::BFloat16>(
          q.data_ptr<at::BFloat16>(), k_caches[l].data_ptr<at::BFloat16>(),
          v_caches[l].data_ptr<at::BFloat16>(), tables.data_ptr<int64_t>(),
          lens.data_ptr<int64_t>(), attn.data_ptr<at::BFloat16>(), heads, kv_heads, dim,
          slots_per_head, tables.size(1), block_size, (float)scale, first, last);
#pragma omp barrier
      gemv(attn, l * LAYER_TENSORS + 3, o);
#pragma omp barrier
      auto post = norm::add_rms_norm(o, normed[1], lw[5], eps, false);
      gemv(post[0], l * LAYER_TENSORS + 6, gate_up);
#pragma omp barrier
      auto act = at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
      gemv(act, l * LAYER_TENSORS + 8, down);
#pragma omp barrier
      own_residual = post[1];
      input = down;
    }
#pragma omp master
    residual = own_residual;
  }
  return {down, residual};
}
"""

SOURCE = "\n".join([*INCLUDES, *(_region(name, m) for name, m in KERNELS.items()), LAYER])
# One set of flags for all four, the one cpu_norm and cpu_decode build with, so each gives
# the same bits as its own module: GCC's optimize pragma, per region, did not (it left the
# attention's loops scalar, 5.7x slower, and reordered the norm's sums). The GEMV is
# intrinsics, which reassociation leaves alone; the rotary rounds each product to bf16
# before the add, so there is nothing to contract into an FMA (its float32 instance, which
# cpu_rope builds with -ffp-contract=off, never runs here).
KERNEL = cpu_kernels.Kernel("cpu_layer", SOURCE, "decode_step", "fused decode step",
                            cpu_decode.CFLAGS, ("-fopenmp",), cpu_kernels.BF16)  # fmt: skip


@functools.cache
def load():
    """The compiled module, or None where this CPU lacks AVX512-BF16 or the build fails."""
    if cpu_gemv.load() is None:
        return None
    return cpu_kernels.build(KERNEL)


def _weights(layer) -> list[torch.Tensor] | None:
    """The layer's tensors in decode_step's order, or None where it is not plain Llama's
    on cpu_gemv's kernel."""
    projections = [getattr(layer, name) for name in cpu_gemv.PROJECTIONS]
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    plain = (not layer.qk_norm and layer.act is torch.nn.functional.silu
             and not any(norm.offset for norm in norms)
             and all(isinstance(p, cpu_gemv.GemvLinear) for p in projections))  # fmt: skip
    if not plain:
        return None
    qkv, o, gate_up, down = projections
    return [norms[0].weight, qkv.weight, qkv.bias_f32, o.weight, o.bias_f32, norms[1].weight,
            gate_up.weight, gate_up.bias_f32, down.weight, down.bias_f32]  # fmt: skip


class FusedDecode:
    """The model's forward for the steps it fits: its layers in one decode_step call."""

    def __init__(self, model, weights: list[list[torch.Tensor]]):
        self.model = model
        self.weights = [t for layer in weights for t in layer]  # decode_step's flat order

    @classmethod
    def of(cls, model) -> "FusedDecode | None":
        """For a bf16 model whose every layer fits, where the module builds; else None."""
        if model.lm_head.weight.dtype != torch.bfloat16:
            return None
        weights = [_weights(layer) for layer in model.layers]
        if any(w is None for w in weights) or load() is None:
            return None
        return cls(model, weights)

    def fits(self, meta, kv: KVCache, lora, rows: int) -> bool:
        """A decode-only step through cpu_decode's kernel, no adapter rows, a cache in the
        model dtype, and few enough rows for the GEMV kernel."""
        return (lora is None and isinstance(meta, AttentionMetadata) and meta.cpu_kernel
                and not meta.prefills and len(meta.decode_buckets) == 1
                and rows <= cpu_gemv.GEMV_MAX_ROWS
                and kv.raw_dtype == torch.bfloat16)  # fmt: skip

    def __call__(self, input_ids, positions, kv: KVCache, meta: AttentionMetadata,
                 logits_index: torch.Tensor) -> torch.Tensor:  # fmt: skip
        model, bucket, layer0 = self.model, meta.decode_buckets[0], self.model.layers[0]
        x, cos, sin = model.embed(input_ids, positions)
        x, residual = load().decode_step(x, self.weights, cos, sin, kv.k, kv.v,
                                         meta.slot_mapping, bucket.blocks, bucket.context_lens,
                                         layer0.num_heads, kv.block_size, layer0.scale,
                                         layer0.input_layernorm.eps)  # fmt: skip
        return model.logits(x, residual, logits_index)
