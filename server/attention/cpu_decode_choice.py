"""Whether an engine on CPU decodes through cpu_decode's kernel or through torch.

The kernel does not win everywhere (float32 on an AVX-512 Xeon without AVX512-BF16: 452
against 417 ms per 40-sequence step), so `choose()` times both paths on the model's
shapes when an engine starts and keeps the verdict (server/platform/timing_cache.py)
in torch's extensions cache, keyed by everything the verdict depends on (the kernel's
build target included); later starts read it."""

import hashlib
import logging

import torch

from batchpilot.server.attention import cpu_decode
from batchpilot.server.attention.metadata import build_metadata
from batchpilot.server.attention.paged import paged_attention
from batchpilot.server.kv.cache import FP8_DTYPES, KVCache
from batchpilot.server.platform import timing_cache

log = logging.getLogger("batchpilot.engine")

# The timed batch: decode steps of this many sequences at this context, one layer's call.
TIMED_SEQS, TIMED_CONTEXT = 32, 512
TIMING_BUDGET_S = 1.0  # the interleaved repeats after one warm-up call of each
MIN_REPEATS, MAX_REPEATS = 3, 9


def choose(requested: str, num_heads: int, num_kv_heads: int, head_dim: int,
           dtype: torch.dtype, block_size: int, kv_cache_dtype: str) -> str:  # fmt: skip
    """The CPU decode path of an engine: "cpu_kernel" or "torch". requested is the
    attention_backend knob: torch and cpu_kernel force a path, auto takes the verdict
    cached for these shapes or measures it now."""
    if requested == "torch":
        return "torch"
    fp8 = kv_cache_dtype in FP8_DTYPES
    if requested == "cpu_kernel":
        if fp8:
            raise ValueError("attention_backend cpu_kernel reads K/V in the model dtype: an "
                             "fp8 kv_cache_dtype needs torch or auto")  # fmt: skip
        if cpu_decode.load() is None:
            raise ValueError("attention_backend cpu_kernel: the CPU decode kernel could not "
                             "be built (see the warning above)")  # fmt: skip
        log.info("CPU decode attention: the kernel (attention_backend=cpu_kernel)")
        return "cpu_kernel"
    if fp8 or cpu_decode.load() is None:
        return "torch"
    shapes = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  dtype=str(dtype).removeprefix("torch."), block_size=block_size)  # fmt: skip
    key = verdict_key(shapes)
    path = timing_cache.path_for(verdict_dir(), "decode", key)
    verdict, source = timing_cache.read(path, key, ("cpu_kernel", "torch")), "cached"
    if verdict is None:
        kernel_ms, torch_ms = time_both(num_heads, num_kv_heads, head_dim, dtype, block_size)
        choice = "cpu_kernel" if kernel_ms < torch_ms else "torch"
        verdict = {"key": key, "choice": choice, "kernel_ms": kernel_ms, "torch_ms": torch_ms}
        source = "measured" if timing_cache.write(path, verdict) else "measured, not cached"
    log.info("CPU decode attention: kernel %.2f ms vs torch %.2f ms per layer at %d sequences "
             "x %d tokens (%s); using %s (%s)", verdict["kernel_ms"], verdict["torch_ms"],
             TIMED_SEQS, TIMED_CONTEXT, shapes["dtype"],
             "the kernel" if verdict["choice"] == "cpu_kernel" else "torch", source)  # fmt: skip
    return verdict["choice"]


def verdict_key(shapes: dict) -> str:
    """Everything a verdict depends on: the kernel's code and flags, the CPU, torch, the
    threads it runs on, and the model's attention shapes."""
    build = cpu_decode.SOURCE + " ".join(cpu_decode.CFLAGS)
    code = hashlib.sha256(build.encode()).hexdigest()[:12]
    target = getattr(cpu_decode.load(), "batchpilot_target", "native")  # -march of the build
    return timing_cache.key(code=code, target=target, seqs=TIMED_SEQS, context=TIMED_CONTEXT,
                            **shapes)  # fmt: skip


# Not the kernel's own folder: a prebuilt kernel's is in the image, read-only. Called
# through this name, which tests point at a folder of their own.
verdict_dir = timing_cache.verdict_dir


@torch.inference_mode()
def time_both(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              block_size: int) -> tuple[float, float]:  # fmt: skip
    """Median ms of one layer's decode attention through the kernel and through torch
    (the engine's own paged_attention, K/V write included), TIMED_SEQS sequences of
    TIMED_CONTEXT tokens on scrambled blocks; calls interleaved so drifting load from
    other processes hits both alike."""
    cpu = torch.device("cpu")
    per_seq = -(-TIMED_CONTEXT // block_size)
    num_blocks = TIMED_SEQS * per_seq
    kv = KVCache(1, num_blocks, 0, block_size, num_kv_heads, head_dim, dtype, "auto", cpu)
    gen = torch.Generator().manual_seed(0)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    order = torch.randperm(num_blocks, generator=gen).view(TIMED_SEQS, per_seq).tolist()
    seqs = [(table, TIMED_CONTEXT - 1, 1) for table in order]
    q = torch.randn(TIMED_SEQS, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(TIMED_SEQS, num_kv_heads, head_dim, generator=gen).to(dtype)
    metas = {kernel: build_metadata(seqs, TIMED_SEQS, block_size, dtype, cpu, kernel)
             for kernel in (True, False)}  # fmt: skip

    def run(kernel: bool) -> None:
        paged_attention(q, k, k, kv, 0, metas[kernel], head_dim**-0.5)

    return timing_cache.time_both(run, TIMING_BUDGET_S, MIN_REPEATS, MAX_REPEATS)
