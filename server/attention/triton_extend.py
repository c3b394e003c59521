"""Triton prefill/extend attention for chunked prefill: every prefill chunk of a step in
one launch, each chunk's queries attending to the sequence's cached prefix in the paged
cache and, causally, to the chunk's own new K/V.

One program covers BLOCK_M queries of one chunk and one query head. Two loops share one
online softmax (base 2): first the prefix [0, prefix_len) read through the block table
(fp8 bytes widened to the query dtype, K scale folded into the softmax scale, V scale
applied to the accumulator once the prefix is done, which is exact because later
rescaling is linear), then the chunk's own tokens straight from the new, unquantized
K/V with the causal mask. A fresh prompt is the case prefix_len == 0. Reading the chunk
from the new K/V rather than the cache means an fp8 cache quantizes only the prefix a
chunk sees; the torch path does the same for fresh prompts (SDPA on the new K/V) but
reads a later chunk's own tokens back from the cache.

Query heads of one group re-read the same K/V rows; they come from L2, and per-head
programs keep tiles small enough for long chunks.
"""

import torch
import triton
import triton.language as tl

from batchpilot.server.attention.triton_decode import (
    LOG2E,
    MIN_MMA,
    TRITON_FP8,
    dot_config,
    load_kv_tile,
    softmax_step,
)
from batchpilot.server.kv.cache import KVCache

EXTEND_BLOCK_M = 64  # queries per program
EXTEND_BLOCK_N = 64  # keys per loop iteration


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    chunk_rows_ptr, chunk_lens_ptr, prefix_lens_ptr, tables_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, q_token_stride, q_head_stride, new_token_stride, new_head_stride,
    cache_head_stride, cache_slot_stride, table_stride, out_token_stride,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, FP8_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    chunk, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    chunk_len = tl.load(chunk_lens_ptr + chunk)
    if tile * BLOCK_M >= chunk_len:
        return
    first_row = tl.load(chunk_rows_ptr + chunk).to(tl.int64)
    prefix_len = tl.load(prefix_lens_ptr + chunk)
    kv_head = head // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    dims = tl.arange(0, DIM_P2)
    row_mask, dim_mask = rows < chunk_len, dims < HEAD_DIM
    q_offsets = (first_row + rows)[:, None] * q_token_stride + head * q_head_stride + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0)
    q = q.to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P2], tl.float32)

    prefix_scale = qk_scale
    if FP8:
        prefix_scale *= tl.load(k_scale_ptr + kv_head)
    table_row = tables_ptr + chunk.to(tl.int64) * table_stride
    head_base = kv_head.to(tl.int64) * cache_head_stride
    for n0 in range(0, prefix_len, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < prefix_len
        k = load_kv_tile(k_cache_ptr, table_row, head_base, pos, valid, dims, dim_mask,
                         cache_slot_stride, BLOCK_SIZE, FP8, FP8_DTYPE, q.dtype)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * prefix_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        v = load_kv_tile(v_cache_ptr, table_row, head_base, pos, valid, dims, dim_mask,
                         cache_slot_stride, BLOCK_SIZE, FP8, FP8_DTYPE, q.dtype)  # fmt: skip
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
    if FP8:
        acc *= tl.load(v_scale_ptr + kv_head)

    # The chunk's own keys: only those at or before the last query of this tile.
    last = tl.minimum(chunk_len, (tile + 1) * BLOCK_M)
    for n0 in range(0, last, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < chunk_len
        kv_offsets = (first_row + cols)[:, None] * new_token_stride + kv_head * new_head_stride
        kv_mask = col_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + kv_offsets + dims[None, :], mask=kv_mask, other=0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(col_mask[None, :] & (cols[None, :] <= rows[:, None]), s, float("-inf"))
        v = tl.load(v_ptr + kv_offsets + dims[None, :], mask=kv_mask, other=0).to(DOT_DTYPE)
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / l_i[:, None]
    out_offsets = (first_row + rows)[:, None] * out_token_stride + head * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])  # fmt: skip


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache,
                     layer: int, chunk_rows: torch.Tensor, chunk_lens: torch.Tensor,
                     prefix_lens: torch.Tensor, tables: torch.Tensor, max_chunk_len: int,
                     scale: float, out: torch.Tensor, block_m: int = EXTEND_BLOCK_M,
                     block_n: int = EXTEND_BLOCK_N) -> None:  # fmt: skip
    """q: [tokens, heads, dim], k, v: [tokens, kv_heads, dim] (the step's flat rows);
    per chunk: first row, length, cached prefix length and block table row (int32)
    -> out rows of each chunk: [tokens, heads * dim]."""
    num_chunks = chunk_lens.shape[0]
    _, num_heads, head_dim = q.shape
    k, v = k.contiguous(), v.contiguous()
    k_cache, v_cache = kv.k[layer], kv.v[layer]
    grid = (num_chunks, num_heads, triton.cdiv(max_chunk_len, block_m))
    _extend_kernel[grid](
        q, k, v, k_cache, v_cache, out,
        chunk_rows, chunk_lens, prefix_lens, tables, kv.k_scale[layer], kv.v_scale[layer],
        scale * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        k_cache.stride(0), k_cache.stride(1), tables.stride(0), out.stride(0),
        GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim,
        DIM_P2=max(MIN_MMA, triton.next_power_of_2(head_dim)), BLOCK_SIZE=kv.block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, FP8=kv.is_fp8,
        FP8_DTYPE=TRITON_FP8.get(kv.dtype, tl.float32),
        **dot_config(q.dtype),
    )  # fmt: skip
