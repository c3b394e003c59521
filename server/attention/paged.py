"""Reference paged attention in torch; runs on CPU and CUDA.

K/V for the new tokens are written to the cache first, then every query reads its
whole context back through its block table, so cached prefixes, chunked prefills and
decodes take the same path.
"""

import torch
import torch.nn.functional as F

from batchpilot.server.attention.metadata import AttentionMetadata
from batchpilot.server.kv.cache import KVCache


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache,
                    layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] -> [tokens, heads * dim]."""
    kv.write(layer, meta.slot_mapping, k, v)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads * head_dim)
    nd = meta.num_decodes
    if nd:
        ck, cv = kv.read(layer, meta.decode_slots)  # [nd, ctx, kvh, d]
        # Queries grouped under their KV head: no K/V repeat needed for GQA.
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(
            qd, ck.transpose(1, 2), cv.transpose(1, 2), attn_mask=meta.decode_mask, scale=scale
        )
        out[:nd] = o.reshape(nd, num_heads * head_dim)
    if meta.prefill_query_index is not None:
        ck, cv = kv.read(layer, meta.prefill_slots)  # [np, ctx, kvh, d]
        qp = q[meta.prefill_query_index].transpose(1, 2)  # [np, heads, max_q, d]
        o = F.scaled_dot_product_attention(
            qp, ck.transpose(1, 2), cv.transpose(1, 2), attn_mask=meta.prefill_mask,
            scale=scale, enable_gqa=group > 1,
        )
        o = o.transpose(1, 2).reshape(*meta.prefill_query_index.shape, num_heads * head_dim)
        out[nd:] = o[meta.prefill_query_valid]
    return out
