"""The CPU decode kernel that reads K/V blocks in place, against the torch path (gather
the blocks, masked matmuls, softmax) on scrambled block tables and uneven contexts."""

import pytest
import torch

from batchpilot.server.attention import cpu_decode
from batchpilot.server.attention.paged import _decode_attention

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason="no C++ toolchain here")

KV_HEADS, GROUP, DIM, BLOCK, NUM_BLOCKS = 2, 3, 16, 4, 64


def torch_reference(q, k_cache, v_cache, tables, lens, scale):
    n, width = tables.shape
    gather = lambda c: c.view(KV_HEADS, NUM_BLOCKS, BLOCK, DIM).index_select(1, tables.flatten())  # noqa: E731
    k = gather(k_cache).view(KV_HEADS, n, width * BLOCK, DIM)
    v = gather(v_cache).view(KV_HEADS, n, width * BLOCK, DIM)
    allowed = torch.arange(width * BLOCK)[None, :] < lens[:, None]
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    qd = q.view(n, KV_HEADS, GROUP, DIM).transpose(0, 1)
    o = _decode_attention(qd, k, v, mask[None, :, None, :], scale)
    return o.transpose(0, 1).reshape(n, KV_HEADS * GROUP * DIM)


# float16 keeps enough mantissa to catch an error in the kernel's own exp, which the
# 16-bit types use (float32 keeps libm's, in double).
@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)]
)
def test_kernel_matches_the_gathering_torch_path(dtype, atol):
    torch.manual_seed(0)
    k_cache = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, DIM, dtype=dtype)
    v_cache = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, DIM, dtype=dtype)
    lens = torch.tensor([1, 3, 4, 5, 17, 30])  # within a block, at its edge, across several
    width = -(-int(lens.max()) // BLOCK)
    tables = torch.randperm(NUM_BLOCKS)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), KV_HEADS * GROUP, DIM, dtype=dtype)
    got = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, BLOCK, DIM**-0.5)
    want = torch_reference(q, k_cache, v_cache, tables, lens, DIM**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


def test_a_failed_build_leaves_the_torch_path(monkeypatch):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    assert cpu_decode.load.__wrapped__() is None
