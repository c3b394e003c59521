"""Per-step metadata for the Triton backend, built once per step and shared by every layer.

Plain int32 tensors the kernels index directly: block tables padded to the widest row
(padding is never read: every load is masked by a context length), context lengths for
decodes, and first row, length and cached prefix length for each prefill chunk. The
decode split count is fixed here, once per step, so every layer launches the same grid.
This module does not import triton, so the dispatch can test for it on any install.
"""

from dataclasses import dataclass

import torch

DECODE_BLOCK_N = 64  # context tokens per decode loop iteration; splits are multiples
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64: where each new token's K/V is written
    num_decodes: int
    decode_tables: torch.Tensor  # [decodes, max_blocks] int32
    context_lens: torch.Tensor  # [decodes] int32, the new token included
    num_splits: int
    tokens_per_split: int
    chunk_rows: torch.Tensor  # [chunks] int32: first row of each prefill chunk
    chunk_lens: torch.Tensor  # [chunks] int32
    prefix_lens: torch.Tensor  # [chunks] int32: tokens already in the cache before it
    chunk_tables: torch.Tensor  # [chunks, max_blocks] int32
    max_chunk_len: int


def num_splits_for(num_seqs: int, num_kv_heads: int, max_context_len: int,
                   num_sms: int) -> int:  # fmt: skip
    """Context splits per decode so that about two programs run per SM, while every
    split keeps at least MIN_TOKENS_PER_SPLIT tokens."""
    wanted = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, max_context_len // MIN_TOKENS_PER_SPLIT))


def tokens_per_split(max_context_len: int, num_splits: int) -> int:
    per_split = -(-max_context_len // num_splits)
    return -(-per_split // DECODE_BLOCK_N) * DECODE_BLOCK_N


def build_triton_metadata(seqs: list[tuple[list[int], int, int]], num_decodes: int,
                          block_size: int, num_kv_heads: int, num_sms: int,
                          device) -> TritonMetadata:  # fmt: skip
    """seqs: (block_table, num_computed_tokens, num_new_tokens), decodes first."""
    slots = []
    for table, start, n in seqs:
        slots.extend(table[p // block_size] * block_size + p % block_size
                     for p in range(start, start + n))  # fmt: skip
    decodes, prefills = seqs[:num_decodes], seqs[num_decodes:]
    context_lens = [start + n for _, start, n in decodes]
    max_context = max(context_lens, default=0)
    splits = num_splits_for(len(decodes), num_kv_heads, max_context, num_sms)
    rows, row = [], num_decodes
    for _, _, n in prefills:
        rows.append(row)
        row += n
    int32 = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
    return TritonMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
        num_decodes=num_decodes,
        decode_tables=int32(_padded([t for t, _, _ in decodes], context_lens, block_size)),
        context_lens=int32(context_lens),
        num_splits=splits,
        tokens_per_split=tokens_per_split(max_context, splits),
        chunk_rows=int32(rows),
        chunk_lens=int32([n for _, _, n in prefills]),
        prefix_lens=int32([start for _, start, _ in prefills]),
        chunk_tables=int32(
            _padded([t for t, _, _ in prefills], [s + n for _, s, n in prefills], block_size)
        ),
        max_chunk_len=max((n for _, _, n in prefills), default=0),
    )


def _padded(tables: list[list[int]], context_lens: list[int], block_size: int):
    """Each table cut to the blocks its context uses, padded with 0 to the widest."""
    used = [-(-n // block_size) for n in context_lens]
    width = max(used, default=0)
    return [t[:u] + [0] * (width - u) for t, u in zip(tables, used, strict=True)]
