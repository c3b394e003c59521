"""Triton multi-LoRA kernels in the shape of punica's BGMV: every row of a batch carries
its own adapter slot, and one launch applies each row's adapter.

A LoRA delta is y += B @ (A @ x), split into two launches around a small float32 h:
shrink (h = A x, d_in -> R) and expand (y += B h, R -> d_out). One program covers one
(row, block of output columns) and computes a GEMV with multiply-and-sum, not tl.dot:
a row is a single vector, so there is no tile for tensor cores and the kernels are
bound by reading the adapter weights. That suits decode (one row per sequence) and is
still correct for prefill, where every token row carries its sequence's slot (SGMV would
load each adapter tile once per segment instead; left for when prefill LoRA shows up in
a profile). Slot -1 means no adapter: shrink writes a zero h row, expand leaves y alone.
Accumulation is float32 throughout; expand rounds to y's dtype once, after the add.
"""

import torch
import triton
import triton.language as tl

# About 4K elements per weight tile: 32 float32 registers a thread at 4 warps.
TILE = 4096


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, slots_ptr,
    x_row_stride, a_slot_stride, a_rank_stride, h_row_stride,
    D_IN, R,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    h_row = h_ptr + row * h_row_stride + ranks
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # no adapter: a zero h keeps any later use of this row a no-op
        tl.store(h_row, tl.zeros([BLOCK_R], tl.float32), mask=rank_mask)
        return
    a_rows = a_ptr + slot * a_slot_stride + ranks[:, None] * a_rank_stride
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, D_IN, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < D_IN
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=col_mask, other=0.0)
        a = tl.load(a_rows + cols[None, :], mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(h_row, acc, mask=rank_mask)


@triton.jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, slots_ptr,
    y_row_stride, h_row_stride, b_slot_stride, b_out_stride,
    D_OUT, R,
    R_P2: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # no adapter: y's row is left exactly as it was
        return
    # R is small (8..256): the whole h row and a [BLOCK_N, R] slice of B fit one tile.
    ranks = tl.arange(0, R_P2)
    rank_mask = ranks < R
    h = tl.load(h_ptr + row * h_row_stride + ranks, mask=rank_mask, other=0.0).to(tl.float32)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = outs < D_OUT
    b = tl.load(
        b_ptr + slot * b_slot_stride + outs[:, None] * b_out_stride + ranks[None, :],
        mask=out_mask[:, None] & rank_mask[None, :],
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    y_row = y_ptr + row * y_row_stride + outs
    y = tl.load(y_row, mask=out_mask)
    tl.store(y_row, (y.to(tl.float32) + delta).to(y.dtype), mask=out_mask)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension densely; copy only when it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [n, d_in], a [S, R, d_in] (x's dtype), slots [n] in [-1, S) -> h [n, R] float32:
    h[i] = a[slots[i]] @ x[i], zero where slots[i] == -1."""
    n, d_in = x.shape
    rank = a.shape[1]
    assert a.shape[2] == d_in and slots.shape == (n,), (x.shape, a.shape, slots.shape)
    h = torch.empty(n, rank, dtype=torch.float32, device=x.device)
    if n == 0:
        return h
    x, a = _unit_last_stride(x), _unit_last_stride(a)
    block_r = min(triton.next_power_of_2(rank), 64)
    block_k = min(triton.next_power_of_2(d_in), TILE // block_r)
    _shrink_kernel[(n, triton.cdiv(rank, block_r))](
        x, a, h, slots,
        x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        d_in, rank,
        BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                offset: int = 0) -> None:  # fmt: skip
    """In place: y[i, offset:offset + d_out] += b[slots[i]] @ h[i] for rows with a slot;
    y [n, d_total] (a row-strided view is fine), h [n, R] float32 (strided is fine),
    b [S, d_out, R] (y's dtype). Rows with slot -1 are untouched."""
    n, rank = h.shape
    d_out = b.shape[1]
    assert b.shape[2] == rank and slots.shape == (n,), (h.shape, b.shape, slots.shape)
    assert y.shape[0] == n and offset + d_out <= y.shape[1], (y.shape, offset, d_out)
    assert y.stride(-1) == 1, "y is written in place: its last dimension must be dense"
    if n == 0:
        return
    h, b = _unit_last_stride(h), _unit_last_stride(b)
    r_p2 = triton.next_power_of_2(rank)
    block_n = min(triton.next_power_of_2(d_out), max(TILE // r_p2, 16))
    # y[:, offset:] is a view: the kernel sees its base pointer and y's row stride.
    _expand_kernel[(n, triton.cdiv(d_out, block_n))](
        y[:, offset:], h, b, slots,
        y.stride(0), h.stride(0), b.stride(0), b.stride(1),
        d_out, rank,
        R_P2=r_p2, BLOCK_N=block_n,
    )  # fmt: skip
