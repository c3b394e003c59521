"""Where the engine runs and in which dtype: `device=auto` and `dtype=auto` resolved from
the hardware."""

import torch

from batchpilot.server.platform.cpuinfo import cpu_flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where the hardware computes it fast, else fp16 on GPUs and fp32 on CPUs.
    On an AVX2-only CPU torch runs bf16 matmuls ~80x slower than fp32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return cpu_dtype(cpu_flags())


def cpu_dtype(flags: set[str]) -> torch.dtype:
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32
