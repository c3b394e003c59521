"""Triton paged decode attention: one query token per sequence against its whole context
in the paged cache, read through the block table.

One program covers one (sequence, KV head, context split). The KV head's group of query
heads forms the rows of a tl.dot tile (padded to 16, the smallest MMA shape), so K and V
are read once per group and grouped-query attention costs no repeat. Long contexts with
few sequences are split across programs (flash-decoding): each split keeps a running
max and sum in base 2, writes its normalised partial output and log-sum-exp, and a small
second kernel merges the splits. With one split the first kernel writes the output itself.
The split count is a runtime argument, so a new count compiles nothing.

fp8 caches hold raw bytes: a tile is bitcast to fp8 and widened (exactly) to the query's
dtype so the dot runs on tensor cores; the per-head K scale folds into the softmax scale
and the V scale multiplies the accumulator once at the end.

Under TRITON_INTERPRET=1 the dot operands are widened to float32: the interpreter's
tl.dot on bfloat16 tiles returns garbage (it multiplies the raw 16-bit patterns). On a
GPU they stay in the model dtype, the probabilities rounded to it as flash attention
does; server/bench/gpu.py checks that path against the reference.
"""

import os

import torch
import triton
import triton.language as tl

from batchpilot.server.attention.triton_metadata import DECODE_BLOCK_N
from batchpilot.server.kv.cache import KVCache

TRITON_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
LOG2E = 1.4426950408889634
MIN_MMA = 16  # tl.dot needs every dimension >= 16 on NVIDIA GPUs


def dot_config(dtype: torch.dtype) -> dict:
    """Launch options for the dot operands of a model dtype (see the module docstring).
    float32 tiles are twice the bytes: two pipeline stages keep K and V tiles of 64 x 128
    within an A100's shared memory."""
    if os.environ.get("TRITON_INTERPRET") == "1" or dtype == torch.float32:
        return {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee", "num_stages": 2}
    return {"DOT_DTYPE": TRITON_DTYPES[dtype], "DOT_PRECISION": "tf32", "num_stages": 3}


@triton.jit
def load_kv_tile(cache_ptr, table_row_ptr, head_base, pos, valid, dims, dim_mask,
                 cache_slot_stride, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
                 FP8_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):  # fmt: skip
    """Rows of one KV head of the paged cache at context positions pos -> [len(pos), dims]
    in OUT_DTYPE; positions not valid read as 0."""
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    offsets = head_base + slot[:, None] * cache_slot_stride + dims[None, :]
    x = tl.load(cache_ptr + offsets, mask=valid[:, None] & dim_mask[None, :], other=0)
    if FP8:
        x = x.to(FP8_DTYPE, bitcast=True)
    return x.to(OUT_DTYPE)


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores s and values v into the running max, sum and output.
    Callers start every row with a tile holding at least one unmasked score, so m_i is
    finite from then on and exp2 never sees -inf - -inf."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, context_lens_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
    q_token_stride, q_head_stride, cache_head_stride, cache_slot_stride, table_stride,
    out_token_stride, tokens_per_split, num_splits,
    SPLIT: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, FP8: tl.constexpr, FP8_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)
    rows = tl.arange(0, GROUP_P2)
    dims = tl.arange(0, DIM_P2)
    row_mask, dim_mask = rows < GROUP, dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q_offsets = seq.to(tl.int64) * q_token_stride + heads[:, None] * q_head_stride + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0)
    q = q.to(DOT_DTYPE)
    if FP8:
        qk_scale *= tl.load(k_scale_ptr + kv_head)
    table_row = tables_ptr + seq.to(tl.int64) * table_stride
    head_base = kv_head.to(tl.int64) * cache_head_stride
    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = load_kv_tile(k_cache_ptr, table_row, head_base, pos, valid, dims, dim_mask,
                         cache_slot_stride, BLOCK_SIZE, FP8, FP8_DTYPE, q.dtype)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        v = load_kv_tile(v_cache_ptr, table_row, head_base, pos, valid, dims, dim_mask,
                         cache_slot_stride, BLOCK_SIZE, FP8, FP8_DTYPE, q.dtype)  # fmt: skip
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
    if FP8:
        acc *= tl.load(v_scale_ptr + kv_head)
    # An empty split (context shorter than its start) has l_i == 0: weight 0 when merged.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if not SPLIT:
        offsets = seq.to(tl.int64) * out_token_stride + heads[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (seq * GROUP * tl.num_programs(1) + heads).to(tl.int64) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * DIM_P2 + dims[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, out_token_stride, num_splits,
    SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, DIM_P2)
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=splits < num_splits, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    mask = (splits[:, None] < num_splits) & (dims[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + part[:, None] * DIM_P2 + dims[None, :], mask=mask, other=0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    offsets = seq.to(tl.int64) * out_token_stride + head * HEAD_DIM + dims
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_attention(q: torch.Tensor, kv: KVCache, layer: int, tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                     tokens_per_split: int, num_splits: int = 1,
                     block_n: int = DECODE_BLOCK_N) -> None:  # fmt: skip
    """q: [seqs, heads, dim]; tables: [seqs, max_blocks] int32; context_lens: [seqs] int32
    including the new token, already written -> out: [seqs, heads * dim].
    Split i covers context tokens [i * tokens_per_split, (i + 1) * tokens_per_split)."""
    num_seqs, num_heads, head_dim = q.shape
    k_cache, v_cache = kv.k[layer], kv.v[layer]
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    dim_p2 = max(MIN_MMA, triton.next_power_of_2(head_dim))
    part_out = part_lse = out  # unused with one split
    if num_splits > 1:
        part_out = q.new_empty(num_seqs * num_heads * num_splits, dim_p2, dtype=torch.float32)
        part_lse = q.new_empty(num_seqs * num_heads * num_splits, dtype=torch.float32)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, tables, context_lens, kv.k_scale[layer], kv.v_scale[layer],
        out, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
        out.stride(0), tokens_per_split, num_splits,
        SPLIT=num_splits > 1, GROUP=group, GROUP_P2=max(MIN_MMA, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, DIM_P2=dim_p2, BLOCK_SIZE=kv.block_size, BLOCK_N=block_n,
        FP8=kv.is_fp8, FP8_DTYPE=TRITON_FP8.get(kv.dtype, tl.float32),
        **dot_config(q.dtype),
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, DIM_P2=dim_p2,
        )  # fmt: skip
