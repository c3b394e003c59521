"""Reference paged attention in torch; runs on CPU and CUDA.

K/V for the new tokens are written to the cache first, then every query reads its
whole context back through its block table, so cached prefixes, chunked prefills and
decodes take the same path. The cache's head-major layout makes the KV head the
leading batch dimension, and each KV head's group of query heads folds into the query
length, so grouped-query attention needs no K/V repeat.
"""

import torch
import torch.nn.functional as F

from batchpilot.server.attention.metadata import AttentionMetadata
from batchpilot.server.kv.cache import KVCache


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache,
                    layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:  # fmt: skip
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] -> [tokens, heads * dim]."""
    kv.write(layer, meta.slot_mapping, k, v)
    num_tokens, num_heads, dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    out = q.new_empty(num_tokens, num_heads * dim)
    nd = meta.num_decodes
    if nd:
        ck, cv = kv.read(layer, meta.decode_blocks)  # [kv_heads, nd, ctx, dim]
        qd = q[:nd].view(nd, kv_heads, group, dim).transpose(0, 1)  # [kv_heads, nd, g, dim]
        o = _decode_attention(qd, ck, cv, meta.decode_mask, scale)
        out[:nd] = o.transpose(0, 1).reshape(nd, num_heads * dim)
    if meta.prefill_query_index is not None:
        ck, cv = kv.read(layer, meta.prefill_blocks)  # [kv_heads, np, ctx, dim]
        npf, max_q = meta.prefill_query_index.shape
        qp = q[meta.prefill_query_index].view(npf, max_q, kv_heads, group, dim)
        qp = qp.permute(2, 0, 3, 1, 4).reshape(kv_heads, npf, group * max_q, dim)
        mask = meta.prefill_mask.repeat(1, 1, group, 1)  # rows ordered (group, query)
        o = F.scaled_dot_product_attention(qp, ck, cv, attn_mask=mask, scale=scale)
        o = o.view(kv_heads, npf, group, max_q, dim).permute(1, 3, 0, 2, 4)
        out[nd:] = o.reshape(npf, max_q, num_heads * dim)[meta.prefill_query_valid]
    return out


def _decode_attention(q, k, v, mask, scale):
    """Plain matmuls: with a handful of query rows per head, CPU flash attention
    spends its time on tiling overhead, and this runs about 2x faster."""
    scores = torch.matmul(q, k.transpose(-1, -2)).to(torch.float32).mul_(scale).add_(mask)
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)
