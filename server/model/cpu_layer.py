"""One C++ call per decoder layer for the CPU's small decode steps: the fused decode step.

At one decoding sequence a bf16 layer's kernels (two norms, four GEMVs, the rotary and
K/V write, the attention) run in about 280 µs on a 2-core EPYC, most of it the weights
streaming, and the Python and torch dispatch around them cost about 80 µs more: a fifth
of the step. For a decode-only step of up to GEMV_MAX_ROWS sequences, with no adapter
rows, this runs each layer as one call into a module that holds the same four kernels
(cpu_norm, cpu_gemv, cpu_rope, cpu_decode: their sources compiled together here), called
in the same order on the same tensors, so the step's logits are the same bit for bit as
the layer-by-layer path's (tests/unit/engine/test_cpu_layer.py).

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
// x: [n, hidden] (the previous layer's MLP output, or the embeddings with residual empty);
// w: input norm, qkv, its float32 bias (or empty), o, bias, post-attention norm, gate_up,
// bias, down, bias; caches [kv_heads, slots, dim] of this layer -> {MLP output, residual}:
// LlamaDecoder's layer, step for step.
std::vector<torch::Tensor> decode_layer(torch::Tensor x, torch::Tensor residual,
                                        std::vector<torch::Tensor> w, torch::Tensor cos,
                                        torch::Tensor sin, torch::Tensor k_cache,
                                        torch::Tensor v_cache, torch::Tensor slots,
                                        torch::Tensor tables, torch::Tensor lens, int64_t heads,
                                        int64_t block_size, double scale, double eps) {
  auto normed = norm::add_rms_norm(x, residual, w[0], eps, false);
  if (residual.numel() == 0) normed[1] = x;
  auto qkv = gemv::gemv_bf16(normed[0], w[1], w[2]);
  const int64_t n = x.size(0), kv_heads = k_cache.size(0), dim = k_cache.size(2);
  auto qk = qkv.narrow(1, 0, (heads + kv_heads) * dim).view({n, heads + kv_heads, dim});
  auto v = qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view({n, kv_heads, dim});
  rope::rope_and_cache(qk, v, cos, sin, k_cache, v_cache, slots, heads);
  auto attn = decode::paged_decode(qk.narrow(1, 0, heads), k_cache, v_cache, tables, lens,
                                   block_size, scale);
  auto post = norm::add_rms_norm(gemv::gemv_bf16(attn, w[3], w[4]), normed[1], w[5], eps, false);
  auto gate_up = gemv::gemv_bf16(post[0], w[6], w[7]);
  const int64_t inter = gate_up.size(1) / 2;
  auto act = at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
  return {gemv::gemv_bf16(act, w[8], w[9]), post[1]};
}
"""

SOURCE = "\n".join([*INCLUDES, *(_region(name, m) for name, m in KERNELS.items()), LAYER])
# One set of flags for all four, the one cpu_norm and cpu_decode build with, so each gives
# the same bits as its own module: GCC's optimize pragma, per region, did not (it left the
# attention's loops scalar, 5.7x slower, and reordered the norm's sums). The GEMV is
# intrinsics, which reassociation leaves alone; the rotary rounds each product to bf16
# before the add, so there is nothing to contract into an FMA (its float32 instance, which
# cpu_rope builds with -ffp-contract=off, never runs here).
KERNEL = cpu_kernels.Kernel("cpu_layer", SOURCE, "decode_layer", "fused decode layer",
                            cpu_decode.CFLAGS, ("-fopenmp",), cpu_kernels.BF16)  # fmt: skip


@functools.cache
def load():
    """The compiled module, or None where this CPU lacks AVX512-BF16 or the build fails."""
    if cpu_gemv.load() is None:
        return None
    return cpu_kernels.build(KERNEL)


def _weights(layer) -> list[torch.Tensor] | None:
    """The layer's tensors in decode_layer's order, or None where it is not plain Llama's
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
    """The model's forward for the steps it fits, one decode_layer call a layer."""

    def __init__(self, model, weights: list[list[torch.Tensor]]):
        self.model = model
        self.weights = weights
        self.empty = model.lm_head.weight.new_empty(0)

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
        model, run = self.model, load().decode_layer
        bucket, layer0 = meta.decode_buckets[0], model.layers[0]
        (x, cos, sin), residual = model.embed(input_ids, positions), self.empty
        eps = layer0.input_layernorm.eps
        for i, weights in enumerate(self.weights):
            x, residual = run(x, residual, weights, cos, sin, kv.k[i], kv.v[i],
                              meta.slot_mapping, bucket.blocks, bucket.context_lens,
                              layer0.num_heads, kv.block_size, layer0.scale, eps)  # fmt: skip
        return model.logits(x, residual, logits_index)
