"""GFLOP/s of torch's CPU linear at the bundled model's projection shapes, fp32 and bf16,
at decode-sized (32) and prefill-sized (512) rows: which dtype pays on this CPU, and how
far small-M GEMMs fall from the large-M rate. Run pinned, e.g.
`taskset -c 1 .venv/bin/python benchmarks/matmul_shapes.py`."""

import os

import torch

from batchpilot.server.bench.machine import cpu_info, matmul_gflops

# name: (in, out) of SmolLM2-135M's fused projections and its lm_head.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}  # fmt: skip

torch.set_num_threads(len(os.sched_getaffinity(0)))
print(cpu_info(), f"torch threads {torch.get_num_threads()}")
for rows in (32, 512):
    for dtype in (torch.float32, torch.bfloat16):
        rates = {name: matmul_gflops(rows, i, o, dtype) for name, (i, o) in SHAPES.items()}
        print(rows, dtype, "  ".join(f"{name} {rate:.1f}" for name, rate in rates.items()))
