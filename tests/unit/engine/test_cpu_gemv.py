"""The bf16 GEMV kernel: what F.linear computes (one rounding to bf16 apart) at every
decode-sized row count, torch's own linear past them, and a model whose projections and
lm_head it takes over, tied embedding kept."""

import pytest
import torch
import torch.nn.functional as F

from batchpilot.server.model import cpu_gemv
from batchpilot.server.model.llama import from_hf
from batchpilot.server.model.loader import load_hf_model

pytestmark = pytest.mark.skipif(cpu_gemv.load() is None, reason="no AVX512-BF16 CPU here")


def bf16_linear(in_features: int, out_features: int, bias: bool) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    return linear.to(torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_what_f_linear_computes_at_every_row_count(bias):
    linear = bf16_linear(576, 960, bias)
    gemv, unpacked = cpu_gemv.GemvLinear(linear, True), cpu_gemv.GemvLinear(linear, False)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 4, 5, 7, 8, 16, 17, 40):
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            expected, got = F.linear(x, linear.weight, linear.bias), gemv(x)
            torch_above = unpacked(x)
        assert got.shape == expected.shape == (rows, 960) and got.dtype == torch.bfloat16
        exact = x.float() @ linear.weight.float().t() + (linear.bias.float() if bias else 0)
        # Both sum in float32 and round once: at most one bf16 step (1/128 relative) apart.
        torch.testing.assert_close(got.float(), exact, rtol=1 / 128, atol=1e-2)
        torch.testing.assert_close(got, expected, rtol=1 / 64, atol=1e-2)
        if rows > cpu_gemv.GEMV_MAX_ROWS:
            assert torch.equal(torch_above, expected)  # torch's own linear
        else:
            assert torch.equal(torch_above, got)  # the kernel either way


def test_a_3d_input_keeps_its_leading_shape():
    linear = bf16_linear(64, 32, False)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    got = cpu_gemv.GemvLinear(linear, True)(x)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got, F.linear(x, linear.weight), rtol=1 / 64, atol=1e-2)


def test_shapes_the_kernel_cannot_tile_stay_torch_linears():
    assert cpu_gemv.fits(bf16_linear(64, 32, False))
    assert not cpu_gemv.fits(bf16_linear(48, 32, False))  # K not whole 32-wide steps
    assert not cpu_gemv.fits(bf16_linear(64, 30, False))  # N not whole 4-row tiles
    assert not cpu_gemv.fits(torch.nn.Linear(64, 32))  # float32


def test_auto_gives_a_bf16_model_the_kernel_and_keeps_the_tied_lm_head(tiny_model):
    hf = load_hf_model(tiny_model, torch.float32)[0]
    model = from_hf(hf, 64, torch.bfloat16, torch.device("cpu"))
    assert cpu_gemv.apply(model, "auto") == "gemv"
    for layer in model.layers:
        for name in cpu_gemv.PROJECTIONS:
            assert isinstance(getattr(layer, name), cpu_gemv.GemvLinear)
    assert isinstance(model.lm_head, cpu_gemv.GemvLinear)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.packed is not None  # a small model: the prepacked copy for big steps
    forced = from_hf(hf, 64, torch.bfloat16, torch.device("cpu"))
    assert cpu_gemv.apply(forced, "torch") is None and cpu_gemv.apply(forced, "onednn") is None
    assert isinstance(forced.lm_head, torch.nn.Linear)
    assert cpu_gemv.apply(from_hf(hf, 64, torch.float32, torch.device("cpu")), "auto") is None


def test_the_runner_asks_the_kernel_first_for_a_bf16_cpu_engine(tiny_model):
    from batchpilot.server import LLM

    def backend(**config) -> str:
        return LLM(
            tiny_model, dtype="bfloat16", max_model_len=64, **config
        ).engine.runner.linear_backend

    assert backend() == "gemv"
    assert backend(linear_backend="torch") == "torch"
