"""The GPU-side block pool: ref counts, a free list, and prefix caching.

A full block is keyed by a hash chained over its parent block's hash and its own
tokens, so equal hashes mean equal prefixes. A block whose ref count drops to zero
keeps its hash and stays reusable until it is evicted, least recently freed first.
"""

from collections import OrderedDict, deque


class NoFreeBlocks(RuntimeError):
    pass


def chain_hash(parent: int | None, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; LRU first

    @property
    def num_free(self) -> int:
        return len(self.free_uncached) + len(self.evictable)

    def allocate(self) -> int:
        if self.free_uncached:
            block = self.free_uncached.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        else:
            raise NoFreeBlocks("no free KV blocks")
        self.ref_counts[block] = 1
        return block

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    def acquire(self, block: int) -> None:
        """Share a cached block with one more sequence."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        count = self.ref_counts[block]
        if count <= 0:
            raise AssertionError(f"double free of block {block}")
        self.ref_counts[block] = count - 1
        if count == 1:
            if self.block_hash[block] is None:
                self.free_uncached.append(block)
            else:
                self.evictable[block] = None

    def register(self, block: int, block_hash: int) -> None:
        """Mark a full, computed block as reusable for prefixes hashing to block_hash."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:  # same content already cached in another block
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in list(self.evictable):
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
            self.free_uncached.append(block)
        self.evictable.clear()


class SwapSpace:
    """Bounded CPU blocks that hold swapped-out sequences."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreeBlocks("swap space exhausted")
        return [self.free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)
