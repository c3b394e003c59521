"""`batchpilot kernels`: build the C++ CPU kernels ahead of time, as vLLM builds its kernels
at install time, so that no server start waits for a compiler.

Each kernel builds on first use otherwise (torch.utils.cpp_extension, cached in
$TORCH_EXTENSIONS_DIR): 25 s each on a quiet 2-core machine, over 90 s on a loaded one,
which a server's first start would spend before it is Ready. `make run` and `make test`
run this first; a kernel that cannot build (no compiler, a CPU without the instructions)
is reported and the torch path it replaces serves instead."""

import argparse
import importlib
import logging
import time

log = logging.getLogger("batchpilot.engine")

# What each kernel replaces, by the module that builds it (its load() returns None where it
# cannot build or this CPU cannot run it).
KERNELS = {
    "batchpilot.server.attention.cpu_decode": "decode attention (torch's paged attention)",
    "batchpilot.server.model.cpu_norm": "residual add + RMSNorm (nine torch ops)",
    "batchpilot.server.model.cpu_rope": "rotary + K/V cache write (nine torch ops)",
    "batchpilot.server.model.cpu_gemv": "bf16 projections up to 8 rows (torch's F.linear)",
    "batchpilot.server.lora.cpu_lora": "LoRA products (four torch ops a projection)",
}


def build(stem: str, source: str, function: str, what: str, cflags: list[str],
          ldflags: tuple[str, ...] = ()):  # fmt: skip
    """One kernel compiled by torch, or None (logged) where it cannot be built: the torch path
    it replaces is always correct. Cached by torch under a name carrying this CPU's flags, so
    a cache shared with another kind of CPU never loads code built for instructions it
    lacks."""
    from torch.utils.cpp_extension import load_inline

    from batchpilot.server.platform import timing_cache

    try:
        log.info("building the CPU %s kernel (cached after the first time)", what)
        name = f"batchpilot_{stem}_{timing_cache.flags_digest()}"
        return load_inline(name, cpp_sources=source, functions=[function],
                           extra_cflags=cflags, extra_ldflags=list(ldflags))  # fmt: skip
    except Exception as exc:  # any build failure: the torch path is always correct
        log.warning("CPU %s kernel unavailable, using torch: %s", what, exc)
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: every kernel this CPU can run is built."""


def build_all() -> dict[str, tuple[bool, float]]:
    """Kernel module -> (built, seconds), building each once (a cached build loads)."""
    built = {}
    for name in KERNELS:
        module = importlib.import_module(name)  # torch's import is not the kernel's time
        start = time.monotonic()
        built[name] = (module.load() is not None, time.monotonic() - start)
    return built


def run(args: argparse.Namespace) -> int:
    built = build_all()
    for name, (ok, seconds) in built.items():
        state = "ready" if ok else "unavailable, torch serves instead"
        print(f"{name.rsplit('.', 1)[-1]:<11} {state:<34} {seconds:6.1f} s  {KERNELS[name]}")
    return 0  # an unavailable kernel is not an error: the torch path is always correct
