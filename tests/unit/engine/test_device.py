"""dtype=auto: fp32 on AVX2-only CPUs (bf16 matmuls crawl there), bf16 with fast bf16."""

import torch

from batchpilot.server.platform.device import cpu_dtype, cpu_flags, resolve_dtype

CPU = torch.device("cpu")


def test_auto_dtype_on_cpus_needs_hardware_bf16():
    assert cpu_dtype({"sse4_2", "avx", "avx2", "fma", "avx512f"}) == torch.float32
    assert cpu_dtype({"avx2", "avx512f", "avx512_bf16"}) == torch.bfloat16
    assert cpu_dtype({"avx2", "amx_bf16", "amx_tile"}) == torch.bfloat16


def test_auto_dtype_reads_this_machines_flags_and_explicit_dtypes_pass_through():
    flags = cpu_flags()
    assert not flags or "fpu" in flags or "fp" in flags  # x86 or arm /proc/cpuinfo
    assert resolve_dtype("auto", CPU) == cpu_dtype(flags)
    assert resolve_dtype("float16", CPU) == torch.float16
