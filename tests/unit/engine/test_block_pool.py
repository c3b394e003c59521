"""Block pool and KV manager invariants under random operation sequences."""

from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.server.engine.sequence import Sequence
from batchpilot.server.kv import manager
from batchpilot.server.kv.block_pool import BlockPool, SwapSpace
from batchpilot.server.kv.manager import KVCacheManager
from batchpilot.server.sampling.sampling_params import SamplingParams

BLOCK = 4


def check_invariants(pool: BlockPool, live: list[Sequence]) -> None:
    holders: dict[int, int] = {}
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for b in seq.block_table:
            holders[b] = holders.get(b, 0) + 1
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == holders.get(b, 0), f"block {b} ref count drifted"
    free = set(pool.free_uncached) | set(pool.evictable)
    assert len(free) == len(pool.free_uncached) + len(pool.evictable), "block listed twice"
    assert free == {b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0}, "leak"
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h
    # A block shared by several sequences is full and never written again: every
    # holder has computed past its end.
    for seq in live:
        for i, b in enumerate(seq.block_table):
            if holders[b] > 1:
                assert seq.num_computed_tokens >= (i + 1) * BLOCK


ops = st.lists(
    st.tuples(st.sampled_from(["add", "step", "free", "swap"]), st.integers(0, 7)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.booleans())
def test_random_operations_keep_pool_consistent(operations, prefix_caching):
    pool = BlockPool(24, enable_prefix_caching=prefix_caching)
    kv = KVCacheManager(pool, SwapSpace(16), BLOCK)
    live: list[Sequence] = []
    swapped: list[Sequence] = []
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [5] * 13]
    for i, (op, arg) in enumerate(operations):
        if op == "add":
            seq = Sequence(str(i), None, prompts[arg % 3], SamplingParams())
            blocks, hashes = kv.match_prefix(seq)
            if kv.can_admit(seq, blocks):
                kv.admit(seq, blocks, hashes)
                assert kv.allocate_slots(seq, seq.num_uncomputed_tokens)
                live.append(seq)
        elif op == "step" and live:
            seq = live[arg % len(live)]
            seq.num_computed_tokens = seq.num_tokens
            kv.register_computed(seq)
            seq.token_ids.append(arg)
            kv.allocate_slots(seq, 1) or kv.free(seq) or live.remove(seq)
        elif op == "free" and live:
            kv.free(live.pop(arg % len(live)))
        elif op == "swap" and live and kv.can_swap_out(live[arg % len(live)]):
            seq = live.pop(arg % len(live))
            kv.swap_out(seq)
            swapped.append(seq)
        if swapped and kv.can_swap_in(swapped[0]):
            seq = swapped.pop(0)
            kv.swap_in(seq)
            live.append(seq)
        check_invariants(pool, live)
        assert kv.swap.num_free + sum(len(s.cpu_block_table) for s in swapped) == 16
    for seq in live:
        kv.free(seq)
    assert pool.num_free == pool.num_blocks


def test_prefix_hit_shares_blocks_and_lru_evicts_oldest_freed():
    pool = BlockPool(6)
    kv = KVCacheManager(pool, SwapSpace(0), BLOCK)
    a = Sequence("a", None, list(range(9)), SamplingParams())
    kv.admit(a, *kv.match_prefix(a))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.register_computed(a)
    b = Sequence("b", None, [*range(8), 42], SamplingParams())
    blocks, _ = kv.match_prefix(b)
    assert blocks == a.block_table[:2]
    kv.free(a)
    assert pool.num_free == 6 and len(pool.cached) == 2
    # Fresh allocations use uncached blocks before evicting cached ones.
    fresh = [pool.allocate() for _ in range(4)]
    assert not set(fresh) & set(blocks)
    evicted = pool.allocate()
    assert evicted == blocks[1], "the tail block is freed first, so it is evicted first"
    assert len(pool.cached) == 1


def test_forced_digest_collision_never_hits_other_tokens(monkeypatch):
    """Every block key collides; only blocks with the same tokens after the same parent
    may be reused."""
    monkeypatch.setattr(manager, "block_digest", lambda parent, tokens: b"collision")
    pool = BlockPool(8)
    kv = KVCacheManager(pool, SwapSpace(0), BLOCK)
    a = Sequence("a", None, list(range(9)), SamplingParams())
    kv.admit(a, *kv.match_prefix(a))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.register_computed(a)
    assert len(pool.cached) == 1  # the second block's key was taken by the first
    other = Sequence("b", None, [*range(100, 108), 1], SamplingParams())
    assert kv.match_prefix(other) == ([], [])
    # The first block of a's prompt followed by a different second block: the second
    # block's key collides with the cached first block, but its parent and tokens differ.
    same_start = Sequence("c", None, [0, 1, 2, 3, 0, 1, 2, 3, 7], SamplingParams())
    blocks, _ = kv.match_prefix(same_start)
    assert blocks == a.block_table[:1]
