"""Choosing the attention backend, and the dispatch from per-step metadata."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined: run on CPU

import pytest
import torch

from batchpilot.server.attention import (
    AttentionMetadata,
    TritonMetadata,
    attention,
    build_attention_metadata,
    resolve_backend,
)
from batchpilot.server.kv.cache import KVCache

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_torch_on_cpu():
    assert resolve_backend("auto", CPU, "fp8") == "torch"
    assert resolve_backend("torch", CPU, "auto") == "torch"


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch):
    assert resolve_backend("triton", CPU, "auto") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("triton", CPU, "auto")


@pytest.mark.parametrize(
    "capability,kv_cache_dtype,expected",
    [
        ((9, 0), "fp8", "triton"),
        ((8, 9), "fp8_e4m3", "triton"),
        ((8, 0), "fp8_e4m3", "torch"),  # Triton's e4m3 type needs sm89
        ((8, 0), "fp8_e5m2", "triton"),
        ((8, 0), "auto", "triton"),
        ((7, 5), "auto", "torch"),  # bf16 tl.dot needs sm80
    ],
)
def test_auto_on_cuda_follows_compute_capability(monkeypatch, capability, kv_cache_dtype,
                                                 expected):  # fmt: skip
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert resolve_backend("auto", CUDA, kv_cache_dtype) == expected
    assert resolve_backend("torch", CUDA, kv_cache_dtype) == "torch"


def test_auto_stays_on_torch_while_kernels_are_interpreted(monkeypatch):
    """This session's kernels run on the CPU: a GPU engine built in it must not use them."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert resolve_backend("auto", CUDA, "auto") == "torch"
    assert resolve_backend("triton", CUDA, "auto") == "triton"


def test_metadata_type_routes_the_layer_call():
    torch.manual_seed(0)
    kv = KVCache(1, 6, 0, 4, 2, 16, torch.float32, "auto", CPU)
    kv.k.normal_(), kv.v.normal_()
    seqs = [([3, 1], 6, 1), ([0, 5, 2], 2, 7)]  # one decode, one chunk behind a prefix
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    outs = {}
    for backend, kind in (("torch", AttentionMetadata), ("triton", TritonMetadata)):
        meta = build_attention_metadata(backend, seqs, 1, 4, torch.float32, 2, CPU)
        assert isinstance(meta, kind)
        outs[backend] = attention(q, k, v, kv, 0, meta, 0.25)
    err = (outs["triton"] - outs["torch"]).norm() / outs["torch"].norm()
    assert err < 1e-5
