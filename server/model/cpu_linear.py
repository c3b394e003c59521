"""Float32 projections on CPU through oneDNN's linear, with each weight reordered once at
load into oneDNN's blocked layout, where a timing at start-up finds it faster than torch's.

torch's `F.linear` runs float32 through MKL's sgemm. On an AVX2-only AMD EPYC that ran the
bundled model's projections at decode-sized rows at a third to a half of oneDNN's
prepacked rate; on an Intel Xeon with AVX-512 the two were even and one-row calls were
slower prepacked (benchmarks/HISTORY.md). So with `linear_backend=auto`, `apply()` times
both on the model's own weights when a float32 CPU engine starts, keeps the verdict
(server/platform/timing_cache.py) and swaps the decoder layers' projections only where oneDNN wins.

The packed weight replaces the dense one, so memory does not grow. The lm_head stays
dense: when tied, the embedding lookup reads the same tensor. bfloat16 models go to
cpu_gemv's kernel instead, where it builds (the runner asks it first)."""

import logging

import torch
import torch.nn.functional as F
from torch import nn

from batchpilot.server.platform import timing_cache
from batchpilot.server.platform.cpuinfo import cpuinfo_field

log = logging.getLogger("batchpilot.engine")

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# oneDNN's batch hint for the reorder. A weight packed for 32 rows gave the same results
# at every row count from 1 to 256, and hints of 8 to 128 ran alike at decode sizes.
PACKED_ROWS = 32
# Decode-sized steps: one sequence, a few, a typical batch, a full one.
TIMED_ROWS = (1, 8, 32, 64)
TIMING_BUDGET_S = 1.0
MIN_REPEATS, MAX_REPEATS = 3, 15
CHOICES = ("onednn", "torch")


class PrepackedLinear(nn.Module):
    """nn.Linear's forward, the weight held only in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(linear.weight.detach())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return prepacked_linear(x, self.packed, self.bias)


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS)


def prepacked_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def apply(model, requested: str) -> str:
    """The linear path of a CPU model ("onednn" or "torch"), with the decoder layers'
    projections swapped to it. requested is the linear_backend knob: torch and onednn
    force a path; auto takes oneDNN's only for float32 and only where it times faster
    (bf16 under auto goes to cpu_gemv first, where its kernel builds)."""
    dtype = model.lm_head.weight.dtype
    if requested == "torch":
        return "torch"
    if not torch.backends.mkldnn.is_available():
        if requested == "onednn":
            raise ValueError("linear_backend onednn: this torch was built without oneDNN")
        return "torch"
    if requested == "auto":
        if dtype != torch.float32:  # bf16 runs through oneDNN already; fp16 has no use here
            return "torch"
        requested = _verdict(model.layers[0], dtype)
    if requested == "onednn":
        for layer in model.layers:
            for name in PROJECTIONS:
                setattr(layer, name, PrepackedLinear(getattr(layer, name)))
    return requested


def _verdict(layer, dtype: torch.dtype) -> str:
    weights = [getattr(layer, name).weight.detach() for name in PROJECTIONS]
    shapes = [list(w.shape) for w in weights]
    key = verdict_key(shapes, dtype)
    path = timing_cache.path_for(verdict_dir(), "linear", key)
    verdict, source = timing_cache.read(path, key, CHOICES), "cached"
    if verdict is None:
        onednn_ms, torch_ms = time_both(weights)
        choice = "onednn" if onednn_ms < torch_ms else "torch"
        verdict = {"key": key, "choice": choice, "onednn_ms": onednn_ms, "torch_ms": torch_ms}
        source = "measured" if timing_cache.write(path, verdict) else "measured, not cached"
    log.info("CPU linear: oneDNN prepacked %.2f ms vs torch %.2f ms for one layer's "
             "projections at %s rows (%s); using %s (%s)", verdict["onednn_ms"],
             verdict["torch_ms"], "/".join(map(str, TIMED_ROWS)),
             str(dtype).removeprefix("torch."), verdict["choice"], source)  # fmt: skip
    return verdict["choice"]


def verdict_key(shapes: list, dtype: torch.dtype) -> str:
    """Everything the verdict depends on: the CPU, torch and its threads, the shapes."""
    return timing_cache.key(cpu=cpuinfo_field("model name"), shapes=shapes, dtype=str(dtype),
                        rows=TIMED_ROWS, packed_rows=PACKED_ROWS)  # fmt: skip


# Called through this name, which tests point at a folder of their own.
verdict_dir = timing_cache.verdict_dir


@torch.inference_mode()
def time_both(weights: list[torch.Tensor]) -> tuple[float, float]:
    """Median ms of the given projections at every row count of TIMED_ROWS, through
    oneDNN prepacked and through F.linear; calls interleaved so drifting load from other
    processes hits both alike."""
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.randn(rows, w.shape[1], generator=gen).to(w.dtype), w, pack(w))
             for w in weights for rows in TIMED_ROWS]  # fmt: skip

    def run(onednn: bool) -> None:
        for x, w, packed in cases:
            prepacked_linear(x, packed, None) if onednn else F.linear(x, w)

    return timing_cache.time_both(run, TIMING_BUDGET_S, MIN_REPEATS, MAX_REPEATS)
