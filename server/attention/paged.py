"""Reference paged attention in torch; runs on CPU and CUDA.

K/V for the new tokens are written to the cache first, then every query reads its
whole context back through its block table, so cached prefixes, chunked prefills and
decodes take the same path. The cache's head-major layout makes the KV head the
leading batch dimension, and each KV head's group of query heads folds into the query
length, so grouped-query attention needs no K/V repeat.
"""

import torch
import torch.nn.functional as F

from batchpilot.server.attention import cpu_decode
from batchpilot.server.attention.metadata import AttentionMetadata
from batchpilot.server.kv.cache import KVCache


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache,
                    layer: int, meta: AttentionMetadata, scale: float,
                    cached: bool = False) -> torch.Tensor:  # fmt: skip
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] -> [tokens, heads * dim].
    cached: k and v are in the cache already (the CPU's fused rotary + write)."""
    if not cached:
        kv.write(layer, meta.slot_mapping, k, v)
    num_tokens, num_heads, dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    # meta.cpu_kernel is set only where the kernel is built and K/V are in the model
    # dtype (cpu_decode_choice), and then its one bucket holds every decode.
    if meta.cpu_kernel and not meta.prefills and meta.decode_buckets:  # a decode-only step
        bucket = meta.decode_buckets[0]
        return cpu_decode.paged_decode(q, kv.k[layer], kv.v[layer], bucket.blocks,
                                       bucket.context_lens, kv.block_size, scale)  # fmt: skip
    out = q.new_empty(num_tokens, num_heads * dim)
    for bucket in meta.decode_buckets:
        n = bucket.end - bucket.start
        if meta.cpu_kernel:  # reads the blocks where they are: no gathered copy
            out[bucket.start : bucket.end] = cpu_decode.paged_decode(
                q[bucket.start : bucket.end], kv.k[layer], kv.v[layer], bucket.blocks,
                bucket.context_lens, kv.block_size, scale,
            )  # fmt: skip
            continue
        ck, cv = kv.read(layer, bucket.blocks)  # [kv_heads, seqs, ctx, dim]
        qd = q[bucket.start : bucket.end].view(n, kv_heads, group, dim).transpose(0, 1)
        o = _decode_attention(qd, ck, cv, bucket.mask, scale)
        out[bucket.start : bucket.end] = o.transpose(0, 1).reshape(n, num_heads * dim)
    for chunk in meta.prefills:
        rows = slice(chunk.row, chunk.row + chunk.num_tokens)
        qp = q[rows].transpose(0, 1)[None]  # [1, heads, n, dim]
        if chunk.blocks is None:
            kp, vp = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            ck, cv = kv.read(layer, chunk.blocks)  # [kv_heads, 1, ctx, dim]
            o = F.scaled_dot_product_attention(
                qp, ck.transpose(0, 1), cv.transpose(0, 1), attn_mask=chunk.mask,
                scale=scale, enable_gqa=group > 1,
            )  # fmt: skip
        out[rows] = o[0].transpose(0, 1).reshape(chunk.num_tokens, num_heads * dim)
    return out


def _decode_attention(q, k, v, mask, scale):
    """Plain matmuls: with a handful of query rows per head, CPU flash attention
    spends its time on tiling overhead, and this runs about 2x faster."""
    scores = torch.matmul(q, k.transpose(-1, -2)).to(torch.float32).mul_(scale).add_(mask)
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
