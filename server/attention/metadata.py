"""Per-step attention metadata, built once per step and shared by every layer.

The step's tokens are flattened with decodes first (shortest context first), then
prefill chunks. Decodes (one query each) attend in a few batches of similar context
length, so a batch of short contexts is not padded to the longest one. Each prefill
chunk attends on its own, unpadded: a fresh prompt causally over its own K/V, a later
chunk or a prompt behind cached prefix blocks through its block table with an offset
causal mask. Masks are additive (0 or -inf) in the model dtype.
"""

from dataclasses import dataclass, field

import torch

# A decode bucket closes when the next context would need more than this many times the
# blocks of the bucket's shortest one, once it holds enough sequences to be worth a call.
BUCKET_GROWTH = 2
BUCKET_MIN_SEQS = 4


@dataclass
class DecodeBucket:
    start: int  # first decode row
    end: int
    blocks: torch.Tensor  # [seqs, max_blocks]
    mask: torch.Tensor | None  # [1, seqs, 1, max_blocks * block_size]; None for the kernel
    context_lens: torch.Tensor  # [seqs]: the CPU kernel reads only these positions


@dataclass
class PrefillChunk:
    row: int  # first row of the chunk in the flat tokens
    num_tokens: int
    blocks: torch.Tensor | None  # [1, max_blocks] when earlier context is cached, else None
    mask: torch.Tensor | None  # [1, 1, num_tokens, max_blocks * block_size] with blocks


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens]: where each new token's K/V is written
    num_decodes: int
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    cpu_kernel: bool = False  # decodes through cpu_decode's kernel (attention_backend)


def _block_table(tables: list[list[int]], context_lens: list[int], block_size: int):
    """-> block ids [seqs, max_blocks] (padding repeats block 0; masked) and key positions."""
    width = -(-max(context_lens) // block_size)
    rows = [blocks[:width] + [0] * (width - len(blocks[:width])) for blocks in tables]
    return torch.tensor(rows, dtype=torch.long), torch.arange(width * block_size)


def _buckets(context_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Row ranges of context_lens (ascending) that share one padded attention call."""
    ranges, start = [], 0
    for i in range(1, len(context_lens) + 1):
        last = i == len(context_lens)
        first_blocks = -(-context_lens[start] // block_size)
        too_long = not last and -(-context_lens[i] // block_size) > BUCKET_GROWTH * first_blocks
        if last or (too_long and i - start >= BUCKET_MIN_SEQS):
            ranges.append((start, i))
            start = i
    return ranges


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def build_metadata(seqs: list[tuple[list[int], int, int]], num_decodes: int, block_size: int,
                   dtype: torch.dtype, device,
                   cpu_kernel: bool = False) -> AttentionMetadata:  # fmt: skip
    """seqs: (block_table, num_computed_tokens, num_new_tokens), decodes first; cpu_kernel:
    decodes read K/V in place through the CPU kernel."""
    slot_mapping = []
    for table, start, n in seqs:
        for p in range(start, start + n):
            slot_mapping.append(table[p // block_size] * block_size + p % block_size)
    meta = AttentionMetadata(
        torch.tensor(slot_mapping, dtype=torch.long, device=device), num_decodes,
        cpu_kernel=cpu_kernel,
    )  # fmt: skip
    decodes, prefills = seqs[:num_decodes], seqs[num_decodes:]
    context_lens = [start + n for _, start, n in decodes]
    # The kernel reads each sequence's own context length, so padding costs it nothing:
    # one call for every decode, and no mask.
    ranges = [(0, num_decodes)] if cpu_kernel and decodes else _buckets(context_lens, block_size)
    for start, end in ranges:
        ctx = context_lens[start:end]
        blocks, pos = _block_table([t for t, _, _ in decodes[start:end]], ctx, block_size)
        lens = torch.tensor(ctx)
        mask = None if cpu_kernel else _additive((pos < lens[:, None])[None, :, None, :], dtype)
        meta.decode_buckets.append(DecodeBucket(start, end, blocks.to(device),
                                                mask if mask is None else mask.to(device),
                                                lens.to(device)))  # fmt: skip
    row = num_decodes
    for table, start, n in prefills:
        chunk = PrefillChunk(row, n, None, None)
        if start:
            blocks, pos = _block_table([table], [start + n], block_size)
            q_pos = start + torch.arange(n)
            chunk.blocks = blocks.to(device)
            chunk.mask = _additive(pos[None, :] <= q_pos[:, None], dtype)[None, None].to(device)
        meta.prefills.append(chunk)
        row += n
    return meta
