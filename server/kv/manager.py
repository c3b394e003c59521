"""Sequence-level KV bookkeeping over the block pool: prefix matching, slot allocation,
hash registration, freeing and swap mappings. No tensors here; the scheduler decides
and kv/cache.py copies."""

from batchpilot.server.engine.sequence import Sequence
from batchpilot.server.kv.block_pool import BlockPool, SwapSpace, block_digest


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, swap: SwapSpace, block_size: int):
        self.pool = pool
        self.swap = swap
        self.block_size = block_size
        self.watermark_blocks = max(1, pool.num_blocks // 100)

    def blocks_to_add(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def block_tokens(self, seq: Sequence, i: int) -> list[int]:
        return seq.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached blocks covering the longest cached prefix, leaving at least one token
        to compute so the step has a position to sample from."""
        blocks, digests, parent = [], [], seq.cache_root
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = self.block_tokens(seq, i)
            digest = block_digest(parent, tokens)
            block = self.pool.lookup(digest, parent, tokens)
            if block is None:
                break
            blocks.append(block)
            digests.append(digest)
            parent = digest
        return blocks, digests

    def can_admit(self, seq: Sequence, cached_blocks: list[int]) -> bool:
        """Room for all of seq's tokens (admission allocates the whole prompt)."""
        fresh = cdiv(seq.num_tokens, self.block_size) - len(cached_blocks)
        # Reusing a cached block that nobody holds takes it off the free list too.
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        return self.pool.num_free - fresh - revived >= self.watermark_blocks

    def admit(self, seq: Sequence, blocks: list[int], hashes: list[bytes]) -> None:
        for b in blocks:
            self.pool.acquire(b)
        seq.block_table = list(blocks)
        seq.block_hashes = list(hashes)
        seq.num_computed_tokens = len(blocks) * self.block_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        n = self.blocks_to_add(seq, num_new_tokens)
        if n > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate() for _ in range(n))
        return True

    def register_computed(self, seq: Sequence, num_new_tokens: int = 0) -> None:
        """Key the blocks that are full once seq's computed tokens and num_new_tokens
        more are in the cache. Keying the blocks the step in flight fills lets a prompt
        admitted later in the same step share them: every layer writes the step's K/V
        before any query reads it."""
        full = (seq.num_computed_tokens + num_new_tokens) // self.block_size
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_root
            seq.block_hashes.append(block_digest(parent, self.block_tokens(seq, i)))
            self._register(seq, i)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        for b in reversed(seq.block_table):
            self.pool.release(b)
        seq.block_table = []

    def forget_uncomputed(self, seq: Sequence) -> None:
        """Take out of the prefix cache the blocks keyed for tokens not yet computed (a
        failed step keyed them when it was scheduled): their K/V may be missing or partial."""
        first = seq.num_computed_tokens // self.block_size
        for block, digest in zip(seq.block_table[first:], seq.block_hashes[first:], strict=False):
            self.pool.forget(block, digest)
        del seq.block_hashes[first:]

    def reset_for_recompute(self, seq: Sequence) -> None:
        self.free(seq)
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.swap.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        cpu = self.swap.allocate(len(seq.block_table))
        mapping = list(zip(seq.block_table, cpu, strict=True))
        self.free(seq)
        seq.cpu_block_table = cpu
        return mapping

    def can_swap_in(self, seq: Sequence) -> bool:
        # Room for the swapped blocks plus the next decode token.
        return len(seq.cpu_block_table) + 1 <= self.pool.num_free - self.watermark_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        gpu = [self.pool.allocate() for _ in seq.cpu_block_table]
        mapping = list(zip(seq.cpu_block_table, gpu, strict=True))
        self.swap.release(seq.cpu_block_table)
        seq.cpu_block_table = []
        seq.block_table = gpu
        for i in range(len(seq.block_hashes)):
            self._register(seq, i)
        return mapping

    def _register(self, seq: Sequence, i: int) -> None:
        """Offer seq's block i, whose digest is known, to the prefix cache."""
        parent = seq.block_hashes[i - 1] if i else seq.cache_root
        tokens = self.block_tokens(seq, i)
        keyed = self.pool.register(seq.block_table[i], seq.block_hashes[i], parent, tokens)
        if keyed and self.pool.events is not None:
            # A first block has no parent in the events: an adapter's root digest is no
            # block, and the adapter travels as lora_name instead.
            self.pool.events.stored(seq.block_hashes[i], parent if i else None, tokens,
                                    seq.lora_name)  # fmt: skip

    def free_swapped(self, seq: Sequence) -> None:
        self.swap.release(seq.cpu_block_table)
        seq.cpu_block_table = []
