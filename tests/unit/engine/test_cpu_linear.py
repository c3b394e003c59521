"""oneDNN's prepacked linear on CPU: it computes what F.linear computes, replaces the dense
weights rather than adding to them, and is chosen by a timing cached per machine."""

import time
from types import SimpleNamespace

import pytest
import torch

from batchpilot.server.config import ConfigError, EngineConfig
from batchpilot.server.model import cpu_linear
from batchpilot.server.model.llama import from_hf
from batchpilot.server.model.loader import load_hf_model


@pytest.fixture
def verdicts(monkeypatch, tmp_path):
    """Verdicts in tmp_path, and a timing that returns what the test sets with
    `fake(onednn_ms, torch_ms)` and counts its calls."""
    timing = SimpleNamespace(calls=0, ms=(1.0, 2.0), dir=tmp_path)
    timing.fake = lambda onednn_ms, torch_ms: setattr(timing, "ms", (onednn_ms, torch_ms))

    def time_both(weights):
        timing.calls += 1
        return timing.ms

    monkeypatch.setattr(cpu_linear, "verdict_dir", lambda: tmp_path)
    monkeypatch.setattr(cpu_linear, "time_both", time_both)
    return timing


@pytest.fixture(scope="module")
def hf_tiny(tiny_model):
    return load_hf_model(tiny_model, torch.float32)[0]


def decoder(hf_model, dtype=torch.float32):
    return from_hf(hf_model, 64, dtype, torch.device("cpu"))


def projections(model):
    return [getattr(layer, name) for layer in model.layers for name in cpu_linear.PROJECTIONS]


@pytest.mark.parametrize("bias", [False, True])
def test_the_prepacked_linear_computes_what_f_linear_computes_at_any_row_count(bias):
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(576, 960, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(960, 576, generator=gen))
    packed = cpu_linear.PrepackedLinear(linear)
    for rows in (1, 3, 8, 31, 32, 33, 64, 200):
        x = torch.randn(rows, 576, generator=gen)
        with torch.inference_mode():
            expected, got = linear(x), packed(x)
        assert got.shape == expected.shape == (rows, 960)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
        assert not torch.equal(got, torch.zeros_like(got))


def test_onednn_swaps_every_projection_and_keeps_no_dense_copy(hf_tiny, verdicts):
    model = decoder(hf_tiny)
    dense = sum(p.numel() for p in model.parameters())
    assert cpu_linear.apply(model, "onednn") == "onednn"
    assert all(isinstance(m, cpu_linear.PrepackedLinear) for m in projections(model))
    weights = sum(m.in_features * m.out_features for m in projections(model))
    assert sum(p.numel() for p in model.parameters()) == dense - weights
    assert verdicts.calls == 0  # forced: nothing timed


def test_auto_takes_the_cached_verdict_after_one_timing(hf_tiny, verdicts, caplog):
    caplog.set_level("INFO", logger="batchpilot.engine")
    assert cpu_linear.apply(decoder(hf_tiny), "auto") == "onednn"  # the fake: 1 ms vs 2 ms
    verdicts.fake(2.0, 1.0)  # a second timing would now pick torch
    model = decoder(hf_tiny)
    assert cpu_linear.apply(model, "auto") == "onednn"
    assert isinstance(model.layers[0].qkv_proj, cpu_linear.PrepackedLinear)
    assert verdicts.calls == 1
    assert len(list(verdicts.dir.glob("linear-verdict-*.json"))) == 1
    lines = [r.getMessage() for r in caplog.records if "CPU linear" in r.message]
    assert "oneDNN prepacked 1.00 ms vs torch 2.00 ms" in lines[0]
    assert lines[0].endswith("using onednn (measured)") and lines[1].endswith("(cached)")


def test_auto_keeps_torch_where_it_times_faster_or_the_dtype_is_not_float32(hf_tiny, verdicts):
    verdicts.fake(2.0, 1.0)
    model = decoder(hf_tiny)
    assert cpu_linear.apply(model, "auto") == "torch"
    assert all(isinstance(m, torch.nn.Linear) for m in projections(model))
    verdicts.fake(1.0, 2.0)
    assert cpu_linear.apply(decoder(hf_tiny, torch.bfloat16), "auto") == "torch"
    assert cpu_linear.apply(decoder(hf_tiny), "torch") == "torch"
    assert verdicts.calls == 1  # bf16 and a forced torch time nothing


def test_an_unwritable_cache_still_decides(hf_tiny, verdicts, monkeypatch):
    blocker = verdicts.dir / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(cpu_linear, "verdict_dir", lambda: blocker / "below")
    assert cpu_linear.apply(decoder(hf_tiny), "auto") == "onednn"
    assert cpu_linear.apply(decoder(hf_tiny), "auto") == "onednn"
    assert verdicts.calls == 2


def test_the_timing_runs_both_paths_quickly(hf_tiny):
    model = decoder(hf_tiny)
    weights = [m.weight for m in projections(model)[:4]]
    start = time.perf_counter()
    onednn_ms, torch_ms = cpu_linear.time_both(weights)
    assert onednn_ms > 0 and torch_ms > 0
    assert time.perf_counter() - start < 10  # ~1 s budget; generous for a loaded machine


def test_onednn_is_for_cpus_only():
    config = EngineConfig(linear_backend="onednn")
    config.resolve(128, "cpu")
    with pytest.raises(ConfigError, match="CPUs only"):
        EngineConfig(linear_backend="onednn").resolve(128, "cuda")
    with pytest.raises(ConfigError, match="linear_backend"):
        EngineConfig(linear_backend="mkl")
