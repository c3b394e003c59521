"""Per-step attention metadata, built once per step and shared by every layer.

The step's tokens are flattened with decodes first, then prefill chunks. Decodes (one
query each) attend as one batch; prefill chunks attend as a padded batch with a causal
mask that also covers each chunk's already-cached context. Masks are additive (0 or
-inf) in the model dtype.
"""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens]: where each new token's K/V is written
    num_decodes: int
    decode_blocks: torch.Tensor | None = None  # [decodes, max_blocks]
    decode_mask: torch.Tensor | None = None  # [1, decodes, 1, max_blocks * block_size]
    prefill_query_index: torch.Tensor | None = None  # [prefills, max_q] into flat tokens
    prefill_query_valid: torch.Tensor | None = None  # [prefills, max_q]
    prefill_blocks: torch.Tensor | None = None  # [prefills, max_blocks]
    prefill_mask: torch.Tensor | None = None  # [1, prefills, max_q, max_blocks * block_size]


def _block_table(tables: list[list[int]], context_lens: list[int], block_size: int):
    """-> block ids [seqs, max_blocks] (padding repeats block 0; masked) and key positions."""
    width = -(-max(context_lens) // block_size)
    table = torch.zeros(len(tables), width, dtype=torch.long)
    for i, blocks in enumerate(tables):
        n = min(len(blocks), width)
        table[i, :n] = torch.tensor(blocks[:n], dtype=torch.long)
    return table, torch.arange(width * block_size)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def build_metadata(seqs: list[tuple[list[int], int, int]], num_decodes: int, block_size: int,
                   dtype: torch.dtype, device) -> AttentionMetadata:  # fmt: skip
    """seqs: (block_table, num_computed_tokens, num_new_tokens), decodes first."""
    slot_mapping = []
    for table, start, n in seqs:
        for p in range(start, start + n):
            slot_mapping.append(table[p // block_size] * block_size + p % block_size)
    meta = AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long), num_decodes)
    decodes, prefills = seqs[:num_decodes], seqs[num_decodes:]
    if decodes:
        ctx = [start + n for _, start, n in decodes]
        meta.decode_blocks, pos = _block_table([t for t, _, _ in decodes], ctx, block_size)
        allowed = pos[None, :] < torch.tensor(ctx)[:, None]
        meta.decode_mask = _additive(allowed[None, :, None, :], dtype)
    if prefills:
        ctx = [start + n for _, start, n in prefills]
        meta.prefill_blocks, pos = _block_table([t for t, _, _ in prefills], ctx, block_size)
        q_lens = torch.tensor([n for _, _, n in prefills])
        starts = torch.tensor([s for _, s, _ in prefills])
        qi = torch.arange(int(q_lens.max()))
        # Padded query rows repeat the chunk's last token, so no mask row is empty.
        last = torch.minimum(qi[None, :], q_lens[:, None] - 1)
        offsets = num_decodes + torch.cumsum(q_lens, 0) - q_lens
        meta.prefill_query_index = offsets[:, None] + last
        meta.prefill_query_valid = qi[None, :] < q_lens[:, None]
        q_pos = starts[:, None] + last
        meta.prefill_mask = _additive((pos[None, None, :] <= q_pos[:, :, None])[None], dtype)
    for name, value in vars(meta).items():
        if isinstance(value, torch.Tensor):
            setattr(meta, name, value.to(device))
    return meta
