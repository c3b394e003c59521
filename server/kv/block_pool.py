"""The GPU-side block pool: ref counts, a free list, and prefix caching.

A full block is keyed by a SHA-256 digest chained over its parent block's digest and its
own token ids, so equal digests mean equal prefixes unless SHA-256 collides. A hit is
still checked against the parent digest and tokens stored with the block: a client that
could craft a colliding key must not get another tenant's KV (vLLM's prefix-cache
collision advisory). A block whose ref count drops to zero keeps its key and stays
reusable until it is evicted, least recently freed first. With KV events on, every key
dropped is reported to `events` (kv/events.py); kv/manager.py reports the keys added.
"""

import hashlib
from array import array
from collections import OrderedDict, deque


class NoFreeBlocks(RuntimeError):
    pass


def block_digest(parent: bytes | None, tokens: list[int]) -> bytes:
    """The key of a full block: SHA-256 over the parent's digest and the token ids."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # What a cached block holds, compared on every hit: (parent digest, token ids).
        self.block_content: list[tuple[bytes | None, tuple[int, ...]] | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # digest -> block id
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; LRU first
        self.events = None  # a KVEventLog where KV events are published

    @property
    def num_free(self) -> int:
        return len(self.free_uncached) + len(self.evictable)

    def allocate(self) -> int:
        if self.free_uncached:
            block = self.free_uncached.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self._uncache(block)
        else:
            raise NoFreeBlocks("no free KV blocks")
        self.ref_counts[block] = 1
        return block

    def lookup(self, digest: bytes, parent: bytes | None, tokens: list[int]) -> int | None:
        """The cached block holding exactly these tokens after this parent, if any."""
        if not self.enable_prefix_caching:
            return None
        block = self.cached.get(digest)
        if block is None or self.block_content[block] != (parent, tuple(tokens)):
            return None
        return block

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

    def register(self, block: int, digest: bytes, parent: bytes | None, tokens: list[int]) -> bool:
        """Mark a full, computed block as reusable for the prefix that digest names; True
        when this keyed it."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return False
        if digest in self.cached:  # same content (or a collision) already cached elsewhere
            return False
        self.block_hash[block] = digest
        self.block_content[block] = (parent, tuple(tokens))
        self.cached[digest] = block
        return True

    def forget(self, block: int, digest: bytes) -> None:
        """Drop block's key if it is digest (it may have been cached under another block)."""
        if self.block_hash[block] != digest:
            return
        self._uncache(block)
        if block in self.evictable:
            del self.evictable[block]
            self.free_uncached.append(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self.evictable):
            self._uncache(block)
            self.free_uncached.append(block)
        self.evictable.clear()

    def _uncache(self, block: int) -> None:
        if self.events is not None:
            self.events.removed(self.block_hash[block])
        del self.cached[self.block_hash[block]]
        self.block_hash[block] = None
        self.block_content[block] = None


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
