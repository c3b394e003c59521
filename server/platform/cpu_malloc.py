"""glibc's malloc told to keep a CPU engine's freed tensors for reuse.

A decode step allocates and frees tensors of megabytes: the logits, the sampler's copies
of them, prefill activations. glibc serves each allocation over its mmap threshold from a
fresh mapping and unmaps it on free. glibc raises that threshold by itself as blocks are
freed, but with a step's mix of sizes the engine still faulted its working set in again
every step, page by page. On the bundled model at 40 sampling sequences that was 7,648 minor faults a step,
and the sampler took 18 ms a step instead of 7 (benchmarks/HISTORY.md). With the mmap
threshold at glibc's ceiling and freed memory kept at the heap's top, the pages are reused
and the step faults none.

The resident set can stay at its peak after a burst instead of shrinking: the memory was
in use at that peak, so a pod's limit already had to allow it.

Where $MALLOC_MMAP_THRESHOLD_, $MALLOC_TRIM_THRESHOLD_ or $MALLOC_TOP_PAD_ is set, whoever
set it has chosen, and nothing changes. Under another malloc (jemalloc or tcmalloc
preloaded) glibc's settings are harmless: that allocator serves the tensors instead."""

import ctypes
import logging
import os

log = logging.getLogger("batchpilot.engine")

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {
    M_MMAP_THRESHOLD: 32 << 20,  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
    M_TRIM_THRESHOLD: 1 << 30,  # hand memory back only past a GiB free at the top
    M_TOP_PAD: 64 << 20,  # grow the heap in steps that hold a step's logits
}
ENV_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Tune this process's glibc malloc (once is enough; again is harmless). False where
    the environment already tunes it or the C library has no mallopt."""
    if any(name in os.environ for name in ENV_KNOBS):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    applied = all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
    if not applied:
        log.warning("glibc mallopt refused a setting; tensors may be page-faulted per step")
    return applied
