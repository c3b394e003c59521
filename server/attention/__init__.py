"""Paged attention: a torch reference for CPU and CUDA (paged.py), and Triton kernels for
GPUs (triton_*.py). The backend is resolved once per engine; each step's metadata is
built for it, and the metadata's type routes every layer's call, so the model has one
call site. triton is imported only when its backend is used: CPU installs need none."""

import functools
import importlib.util
import os

import torch

from batchpilot.server.attention.metadata import AttentionMetadata, build_metadata
from batchpilot.server.attention.paged import paged_attention
from batchpilot.server.attention.triton_metadata import TritonMetadata, build_triton_metadata
from batchpilot.server.kv.cache import FP8_DTYPES


def resolve_backend(name: str, device: torch.device, kv_cache_dtype: str) -> str:
    """auto: triton on CUDA GPUs it supports, torch elsewhere (on CPU the runner then asks
    cpu_decode_choice.choose whether its kernel or torch decodes). cpu_kernel: the CPU decode
    kernel, forced (CPU only). tl.dot on bf16 needs
    Ampere (sm80); Triton's fp8 e4m3 type needs Ada or Hopper (sm89). Under
    TRITON_INTERPRET=1 (set by the kernel tests for the whole test session) kernels run
    interpreted on the CPU, so auto keeps a GPU engine on torch."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if name == "torch":
        return "torch"
    if name == "cpu_kernel":
        if device.type != "cpu":
            raise ValueError("attention_backend cpu_kernel needs the CPU device")
        return "cpu_kernel"
    if name == "triton":
        if device.type != "cuda" and not interpreting:
            raise ValueError("attention_backend triton needs a CUDA device (or TRITON_INTERPRET=1)")
        return "triton"
    if device.type != "cuda" or interpreting or importlib.util.find_spec("triton") is None:
        return "torch"
    e4m3 = FP8_DTYPES.get(kv_cache_dtype) == torch.float8_e4m3fn
    needed = (8, 9) if e4m3 else (8, 0)
    return "triton" if torch.cuda.get_device_capability(device) >= needed else "torch"


def build_attention_metadata(backend: str, seqs: list[tuple[list[int], int, int]],
                             num_decodes: int, block_size: int, dtype: torch.dtype,
                             num_kv_heads: int, device: torch.device):  # fmt: skip
    """seqs: (block_table, num_computed_tokens, num_new_tokens), decodes first."""
    if backend == "triton":
        return build_triton_metadata(
            seqs, num_decodes, block_size, num_kv_heads, num_sms(device), device
        )
    return build_metadata(seqs, num_decodes, block_size, dtype, device, backend == "cpu_kernel")


def attention(q, k, v, kv, layer: int, meta: AttentionMetadata | TritonMetadata,
              scale: float, cached: bool = False) -> torch.Tensor:  # fmt: skip
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] -> [tokens, heads * dim].
    cached: k and v are already in the cache at meta.slot_mapping (cpu_rope wrote them)."""
    if isinstance(meta, TritonMetadata):
        from batchpilot.server.attention.triton_attention import triton_paged_attention

        assert not cached, "the Triton path writes its own K/V"
        return triton_paged_attention(q, k, v, kv, layer, meta, scale)
    return paged_attention(q, k, v, kv, layer, meta, scale, cached)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors: how many decode programs the device runs at once."""
    if device.type != "cuda":
        return 1  # the interpreter: no parallelism to fill
    return torch.cuda.get_device_properties(device).multi_processor_count
