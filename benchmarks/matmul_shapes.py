"""GFLOP/s of torch's CPU linear at the bundled model's projection shapes: which dtype pays
on this CPU, how far decode-sized GEMMs (1-64 rows) fall from the prefill-sized (512) rate,
and whether oneDNN's prepacked linear (weights reordered once, as a loader would) beats
`F.linear` (MKL's sgemm for float32) at those rows. Run pinned, e.g.
`taskset -c 1 .venv/bin/python benchmarks/matmul_shapes.py`; `--rows` and `--dtypes` pick
the cells. Each cell is the best of 5 rounds, the two paths interleaved per shape."""

import argparse
import json
import os
import time

import torch

from batchpilot.server.bench.machine import cpu_info

# name: (in, out) of SmolLM2-135M's fused projections and its lm_head.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}  # fmt: skip


def best_seconds(call, repeats: int = 5, calls: int = 8) -> float:
    """The fastest round: other work on a shared machine only slows a round down."""
    call()  # the library picks and caches its kernel on the first call
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def rates(rows: int, inner: int, cols: int, dtype) -> dict:
    x = torch.randn(rows, inner, dtype=dtype)
    w = torch.randn(cols, inner, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    paths = {
        "linear": lambda: torch.nn.functional.linear(x, w),
        "onednn_prepacked": lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        ),
    }
    flops = 2 * rows * inner * cols
    return {name: flops / best_seconds(call) / 1e9 for name, call in paths.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,32,64,512")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", help="also write the cells to this file")
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    machine = cpu_info() | {"torch_threads": torch.get_num_threads()}
    print(machine)
    cells = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for rows in map(int, args.rows.split(",")):
            line = []
            for name, (inner, cols) in SHAPES.items():
                cell = rates(rows, inner, cols, dtype)
                cells.append({"dtype": dtype_name, "rows": rows, "projection": name} | cell)
                line.append(f"{name} {cell['linear']:.0f}/{cell['onednn_prepacked']:.0f}")
            print(f"{dtype_name} rows {rows}: " + "  ".join(line), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": machine, "cells": cells}, out, indent=1)


if __name__ == "__main__":
    main()
