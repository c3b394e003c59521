"""The machine a benchmark ran on, in the units its figures need: the CPU and its flags,
the threads torch used, and the matmul peak that torch reaches here in the run's dtype.

The peak is measured in the same run as the figures it scales: these machines differ
from one run to the next (AVX512-BF16 or AVX2 only) and are often shared, so a peak from
elsewhere would make the roofline fraction meaningless. torch is imported only where a
peak is measured, so the online load generator stays torch-free."""

import os
import time

from batchpilot.server.platform.cpuinfo import cpu_flags, cpuinfo_field

# The flags that decide how fast torch's CPU matmuls run in each dtype.
MATMUL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
# [rows, in, out]: the bundled model's projections at a prefill-sized M, and a square.
PEAK_SHAPES = ((512, 576, 960), (512, 576, 3072), (512, 1536, 576), (1024, 1024, 1024))


def cpu_info() -> dict:
    flags = cpu_flags()
    return {
        "cpu_model": cpuinfo_field("model name") or "unknown",
        "cpu_flags": [f for f in MATMUL_FLAGS if f in flags],
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1m": os.getloadavg()[0],
    }


def matmul_gflops(rows: int, inner: int, cols: int, dtype, repeats: int = 5) -> float:
    """The fastest of `repeats` timed rounds: other work on a shared machine only slows
    a round down, so the fastest is the least disturbed."""
    import torch

    a = torch.randn(rows, inner, dtype=dtype)
    w = torch.randn(cols, inner, dtype=dtype)
    calls = 4
    torch.nn.functional.linear(a, w)  # oneDNN picks and caches its kernel on first call
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            torch.nn.functional.linear(a, w)
        best = min(best, (time.perf_counter() - start) / calls)
    return 2 * rows * inner * cols / best / 1e9


def describe(dtype) -> dict:
    """cpu_info, torch's threads, and the matmul peak in dtype (a torch.dtype)."""
    import torch

    peak = max(matmul_gflops(*shape, dtype) for shape in PEAK_SHAPES)
    return cpu_info() | {
        "torch_threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "matmul_peak_gflops": peak,
    }


def roofline_seconds(prompt_tokens: int, output_tokens: int, params: int, peak_gflops: float):
    """The workload's arithmetic at the matmul peak: each token costs 2 FLOPs per parameter."""
    return (prompt_tokens + output_tokens) * 2 * params / (peak_gflops * 1e9)
