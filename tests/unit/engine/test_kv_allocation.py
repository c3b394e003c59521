"""The CPU KV cache costs no start-up time for its size: its pages are zero from the kernel
and become resident as they are first written, not all before the server is Ready."""

from __future__ import annotations

import gc

import torch

from batchpilot.server.kv.cache import KVCache, zeroed

CPU = torch.device("cpu")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_zeroed_is_zero_writable_and_of_the_asked_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8):
        t = zeroed((2, 3, 8, 4), dtype, CPU)
        gc.collect()  # the tensor, not a name, keeps its mapping alive
        assert (t.dtype, t.shape, t.is_contiguous()) == (dtype, (2, 3, 8, 4), True)
        assert not t.any()
        t.index_copy_(2, torch.tensor([5]), torch.ones(2, 3, 1, 4, dtype=dtype))
        assert t.sum().item() == 24 and t[:, :, 5].all()


def test_a_large_cpu_kv_cache_is_not_made_resident_when_allocated():
    # 24 layers x 3 heads x 16,384 slots x 64 dims x 4 bytes, for k and for v: 2 x 288 MiB.
    before = resident_bytes()
    kv = KVCache(24, 1024, 0, 16, 3, 64, torch.float32, "auto", CPU)
    grown = resident_bytes() - before
    assert kv.k.shape == (24, 3, 16384, 64) and not kv.k[0, 0, :16].any()
    assert grown < 64 * 2**20, f"{grown / 2**20:.0f} MiB resident after allocating 576 MiB"
    kv.k[:, :, :16] = 1.0  # one block written: only its pages become resident
    assert resident_bytes() - before < 64 * 2**20
