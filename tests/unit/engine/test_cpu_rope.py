"""The fused rotary + K/V write kernel against the decoder's torch path (rotate(), then
KVCache.write): q, k and the cache bit for bit, in every dtype the kernel takes."""

import pytest
import torch

from batchpilot.server.attention.metadata import AttentionMetadata
from batchpilot.server.kv.cache import KVCache
from batchpilot.server.model import cpu_rope
from batchpilot.server.model.llama import rotate

pytestmark = pytest.mark.skipif(cpu_rope.load() is None, reason="no C++ toolchain here")

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 2


def projection_output(n: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """qk and v as the decoder slices them from one fused q/k/v projection: strided rows."""
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    qk, v = qkv.split(((HEADS + KV_HEADS) * DIM, KV_HEADS * DIM), dim=-1)
    return qk.view(n, HEADS + KV_HEADS, DIM), v.view(n, KV_HEADS, DIM)


def rope_tables(n: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(n, 1, DIM // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return cos.to(dtype), torch.cat((-sin[..., : DIM // 2], sin[..., DIM // 2 :]), -1).to(dtype)


def cache(dtype) -> KVCache:
    return KVCache(LAYERS, num_blocks=16, num_cpu_blocks=0, block_size=16, num_kv_heads=KV_HEADS,
                   head_dim=DIM, model_dtype=dtype, kv_cache_dtype="auto",
                   device=torch.device("cpu"))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# A decode, a few rows, a prefill past one thread's share.
@pytest.mark.parametrize("n", [1, 7, 130])
def test_the_kernel_rotates_and_writes_what_torch_does(dtype, n):
    gen = torch.Generator().manual_seed(n)
    qk, v = projection_output(n, dtype, gen)
    cos, sin = rope_tables(n, dtype, gen)
    slots = torch.randperm(256, generator=gen)[:n]
    want_kv, got_kv = cache(dtype), cache(dtype)
    want = rotate(qk, cos, sin)
    want_kv.write(1, slots, want[:, HEADS:], v)
    got = qk.clone()  # dense rows, unlike the projection's strided view below
    got_qk, _ = projection_output(n, dtype, gen)
    got_qk.copy_(qk)
    cpu_rope.rope_and_cache(got_qk, v, cos, sin, got_kv, 1, slots, HEADS)
    assert torch.equal(got_qk, want) and torch.equal(got_kv.k, want_kv.k)
    assert torch.equal(got_kv.v, want_kv.v)
    cpu_rope.rope_and_cache(got, v, cos, sin, cache(dtype), 0, slots, HEADS)
    assert torch.equal(got, want)


def test_padding_slots_are_not_written():
    gen = torch.Generator().manual_seed(0)
    qk, v = projection_output(2, torch.float32, gen)
    cos, sin = rope_tables(2, torch.float32, gen)
    kv = cache(torch.float32)
    cpu_rope.rope_and_cache(qk, v, cos, sin, kv, 0, torch.tensor([5, -1]), HEADS)
    written = (kv.k[0] != 0).any(-1).nonzero()[:, 1].unique().tolist()
    assert written == [5]


def meta() -> AttentionMetadata:
    return AttentionMetadata(torch.tensor([0]), 1)


def test_only_a_cache_in_the_model_dtype_takes_the_kernel():
    qk, _ = projection_output(1, torch.bfloat16, torch.Generator().manual_seed(0))
    assert cpu_rope.usable(qk, cache(torch.bfloat16), meta())
    fp8 = KVCache(LAYERS, 16, 0, 16, KV_HEADS, DIM, torch.bfloat16, "fp8", torch.device("cpu"))
    assert not cpu_rope.usable(qk, fp8, meta())
    assert not cpu_rope.usable(qk, cache(torch.bfloat16), object())  # Triton's metadata
