"""The fused residual add + RMSNorm kernel against the decoder's torch RMSNorm: the sum
bit for bit, the norm within one rounding of the statistics (equal in bf16)."""

import pytest
import torch

from batchpilot.server.model import cpu_norm
from batchpilot.server.model.llama import RMSNorm

pytestmark = pytest.mark.skipif(cpu_norm.load() is None, reason="no C++ toolchain here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [False, True])  # Gemma's (1 + weight)
def test_the_kernel_computes_what_the_torch_norm_computes(dtype, offset):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5, offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen))
    x, residual = (torch.randn(5, 576, generator=gen).to(dtype) for _ in range(2))
    with torch.inference_mode():
        got, total = norm(x, residual)
        assert torch.equal(total, x + residual)
        want = norm._norm(x + residual)
        alone, same = norm(x)
        assert same is x
    # One rounding of the mean apart at most: a last-bit change in float32 and float16;
    # bf16's coarser rounding of the row absorbs it here.
    step = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 0.0}[dtype]
    tolerance = {"rtol": step, "atol": step}
    torch.testing.assert_close(got, want, **tolerance)
    torch.testing.assert_close(alone, norm._norm(x), **tolerance)


def test_heads_normalize_over_the_last_dimension():
    x = torch.randn(3, 4, 64)
    norm = RMSNorm(64, 1e-6)
    with torch.inference_mode():
        got, _ = norm(x)
    torch.testing.assert_close(got, norm._norm(x), rtol=1e-6, atol=1e-6)


def test_a_failed_build_keeps_the_torch_ops(monkeypatch):
    monkeypatch.setattr(cpu_norm, "load", lambda: None)
    norm, x = RMSNorm(64, 1e-6), torch.randn(2, 64)
    with torch.inference_mode():
        got, total = norm(x, x)
    assert torch.equal(total, x + x) and torch.equal(got, norm._norm(x + x))
