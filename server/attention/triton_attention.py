"""The Triton attention backend for one layer of one step: the KV write kernel, then
decode attention for the decode rows and extend attention for every prefill chunk, each
a single launch (plus a merge launch when decodes split their context).

While the cache calibrates fp8 scales the write goes through KVCache.write, which
records the per-head amax; calibration is one short prompt at start-up.
"""

import torch

from batchpilot.server.attention.triton_decode import decode_attention
from batchpilot.server.attention.triton_extend import extend_attention
from batchpilot.server.attention.triton_kv_write import write_kv
from batchpilot.server.attention.triton_metadata import TritonMetadata
from batchpilot.server.kv.cache import KVCache


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache,
                           layer: int, meta: TritonMetadata, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] -> [tokens, heads * dim]."""
    if kv.calibrating:
        kv.write(layer, meta.slot_mapping, k, v)
    else:
        write_kv(kv, layer, meta.slot_mapping, k, v)
    num_tokens, num_heads, head_dim = q.shape
    if out is None:
        out = q.new_empty(num_tokens, num_heads * head_dim)
    decodes = meta.num_decodes
    if decodes:
        decode_attention(
            q[:decodes], kv, layer, meta.decode_tables, meta.context_lens, scale,
            out[:decodes], meta.tokens_per_split, meta.num_splits,
        )  # fmt: skip
    if meta.max_chunk_len:
        extend_attention(
            q, k, v, kv, layer, meta.chunk_rows, meta.chunk_lens, meta.prefix_lens,
            meta.chunk_tables, meta.max_chunk_len, scale, out,
        )  # fmt: skip
    return out
