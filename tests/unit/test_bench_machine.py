"""The machine figures every offline result carries: CPU flags, the matmul peak measured
in the run's dtype, and the workload's roofline."""

import argparse

import pytest
import torch

from batchpilot.server.bench import machine, offline
from batchpilot.server.bench.systems import SystemRun, TokenRequest


def test_roofline_is_two_flops_per_parameter_per_token():
    # 100 + 50 tokens x 2 x 1e6 params = 3e8 FLOPs at 3 GFLOP/s.
    assert machine.roofline_seconds(100, 50, 10**6, 3.0) == pytest.approx(0.1)


def test_cpu_info_lists_only_matmul_flags():
    info = machine.cpu_info()
    assert set(info["cpu_flags"]) <= set(machine.MATMUL_FLAGS)
    assert info["cpus"] >= 1


def test_matmul_gflops_is_positive_in_fp32():
    assert machine.matmul_gflops(8, 16, 32, torch.float32, repeats=1) > 0


def test_offline_summary_scales_each_system_by_the_roofline():
    args = argparse.Namespace(model=None, dtype="float32", concurrency=2, num_prompts=2,
                              output_lens=(4,), prompt_repeats=(1,), seed=0, repeats=1,
                              linear_backend="auto")  # fmt: skip
    requests = [TokenRequest([1] * 6, 4), TokenRequest([1] * 6, 4)]
    host = machine.cpu_info() | {"torch_threads": 1, "dtype": "float32",
                                 "matmul_peak_gflops": 1.0, "params": 10**6}  # fmt: skip
    runs = [SystemRun("batchpilot continuous", 2, 8, 8, 2.0)]
    result = offline.summarize(args, runs, None, requests, host)
    # (12 + 8 tokens) x 2 x 1e6 / 1 GFLOP/s = 0.04 s for 8 tokens: 200 tok/s at the roofline.
    assert result["roofline_seconds"] == pytest.approx(0.04)
    assert result["systems"][0]["roofline_fraction"] == pytest.approx(4.0 / 200)
    assert "matmul peak 1.0 GFLOP/s" in offline.render(result)
