"""Per-step attention metadata, built once per step and shared by every layer.

The step's tokens are flattened with decodes first, then prefill chunks. Decodes (one
query each) attend as one batch; prefill chunks attend as a padded batch with a causal
mask that also covers each chunk's already-cached context.
"""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens]: where each new token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [decodes, max_ctx]: context slots to read
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, max_ctx]
    prefill_query_index: torch.Tensor | None  # [prefills, max_q] into the flat tokens
    prefill_query_valid: torch.Tensor | None  # [prefills, max_q]
    prefill_slots: torch.Tensor | None  # [prefills, max_ctx]
    prefill_mask: torch.Tensor | None  # [prefills, 1, max_q, max_ctx]


def _context_slots(block_tables: list[list[int]], context_lens: list[int], block_size: int,
                   device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> slots [seqs, max_ctx] (padding points at slot 0) and positions [max_ctx]."""
    max_ctx = max(context_lens)
    max_blocks = -(-max_ctx // block_size)
    table = torch.zeros(len(block_tables), max_blocks, dtype=torch.long)
    for i, blocks in enumerate(block_tables):
        n = min(len(blocks), max_blocks)
        table[i, :n] = torch.tensor(blocks[:n], dtype=torch.long)
    pos = torch.arange(max_ctx)
    slots = table[:, pos // block_size] * block_size + pos % block_size
    return slots.to(device), pos.to(device)


def build_metadata(seqs: list[tuple[list[int], int, int]], num_decodes: int, block_size: int,
                   device) -> AttentionMetadata:
    """seqs: (block_table, num_computed_tokens, num_new_tokens), decodes first."""
    slot_mapping = []
    for table, start, n in seqs:
        for p in range(start, start + n):
            slot_mapping.append(table[p // block_size] * block_size + p % block_size)
    meta = AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device),
                             num_decodes, None, None, None, None, None, None)
    decodes, prefills = seqs[:num_decodes], seqs[num_decodes:]
    if decodes:
        ctx = [start + n for _, start, n in decodes]
        slots, pos = _context_slots([t for t, _, _ in decodes], ctx, block_size, device)
        lens = torch.tensor(ctx, device=device)
        meta.decode_slots = slots
        meta.decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :]
    if prefills:
        ctx = [start + n for _, start, n in prefills]
        slots, pos = _context_slots([t for t, _, _ in prefills], ctx, block_size, device)
        q_lens = [n for _, _, n in prefills]
        max_q = max(q_lens)
        offsets, index = num_decodes, []
        for n in q_lens:
            index.append([offsets + min(i, n - 1) for i in range(max_q)])
            offsets += n
        qi = torch.arange(max_q, device=device)
        q_lens_t = torch.tensor(q_lens, device=device)
        starts = torch.tensor([s for _, s, _ in prefills], device=device)
        # Padded query rows reuse the chunk's last position so no mask row is empty.
        q_pos = starts[:, None] + torch.minimum(qi[None, :], q_lens_t[:, None] - 1)
        meta.prefill_query_index = torch.tensor(index, dtype=torch.long, device=device)
        meta.prefill_query_valid = qi[None, :] < q_lens_t[:, None]
        meta.prefill_slots = slots
        meta.prefill_mask = (pos[None, None, :] <= q_pos[:, :, None])[:, None, :, :]
    return meta
