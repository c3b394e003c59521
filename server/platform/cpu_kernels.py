"""`batchpilot kernels`: build the C++ CPU kernels ahead of time, as vLLM builds its kernels
at install time, so that no server start waits for a compiler.

Each kernel builds on first use otherwise (torch.utils.cpp_extension, cached in
$TORCH_EXTENSIONS_DIR): 25 s each on a quiet 2-core machine, over 90 s on a loaded one,
which a server's first start would spend before it is Ready. `make run` and `make test`
run this first; a kernel that cannot build (no compiler, a CPU without the instructions)
is reported and the torch path it replaces serves instead.

`--prebuilt DIR` builds them for named CPU targets instead of this CPU (the server image
carries the result: prebuilt_kernels.py), and `--check` fails where a prebuilt kernel that
this CPU could run does not load."""

import argparse
import importlib
import logging
import time
from pathlib import Path

from batchpilot.server.platform import prebuilt_kernels
from batchpilot.server.platform.cpuinfo import cpu_flags
from batchpilot.server.platform.prebuilt_kernels import BF16, PORTABLE, Kernel

__all__ = ["BF16", "PORTABLE", "Kernel", "build"]

log = logging.getLogger("batchpilot.engine")

# What each kernel replaces, by the module that builds it (its load() returns None where it
# cannot build or this CPU cannot run it).
KERNELS = {
    "batchpilot.server.attention.cpu_decode": "decode attention (torch's paged attention)",
    "batchpilot.server.model.cpu_norm": "residual add + RMSNorm (nine torch ops)",
    "batchpilot.server.model.cpu_rope": "rotary + K/V cache write (nine torch ops)",
    "batchpilot.server.model.cpu_gemv": "bf16 projections up to 8 rows (torch's F.linear)",
    "batchpilot.server.model.cpu_layer": "a decode step's layers in one call (their Python)",
    "batchpilot.server.lora.cpu_lora": "LoRA products (four torch ops a projection)",
}


def build(kernel: Kernel):
    """One kernel's module, or None (logged) where there is none: the torch path it replaces
    is always correct. A prebuilt one for this CPU's best target first
    ($BATCHPILOT_KERNELS_DIR), else compiled here for this CPU (-march=native) by torch,
    cached under a name carrying this CPU's flags, so a cache shared with another kind of
    CPU never loads code built for instructions it lacks."""
    module = prebuilt_kernels.load(kernel, cpu_flags())
    return module if module is not None else build_native(kernel)


def build_native(kernel: Kernel):
    from torch.utils.cpp_extension import load_inline

    from batchpilot.server.platform import timing_cache

    try:
        log.info("building the CPU %s kernel (cached after the first time)", kernel.what)
        name = f"batchpilot_{kernel.stem}_{timing_cache.flags_digest()}"
        module = load_inline(name, cpp_sources=kernel.source, functions=[kernel.function],
                             extra_cflags=[*kernel.cflags, "-march=native"],
                             extra_ldflags=list(kernel.ldflags))  # fmt: skip
    except Exception as exc:  # any build failure: the torch path is always correct
        log.warning("CPU %s kernel unavailable, using torch: %s", kernel.what, exc)
        return None
    module.batchpilot_target = "native"
    return module


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prebuilt", type=Path, metavar="DIR",
                        help="build every kernel for each of its CPU targets into DIR (for an "
                        "image: BATCHPILOT_KERNELS_DIR), not for this CPU")  # fmt: skip
    parser.add_argument("--check", action="store_true",
                        help="only load the prebuilt kernels of $BATCHPILOT_KERNELS_DIR; fail "
                        "where one this CPU could run does not load")  # fmt: skip


def specs() -> dict[str, Kernel]:
    """Kernel module -> its Kernel, every module of KERNELS."""
    return {name: importlib.import_module(name).KERNEL for name in KERNELS}


def build_all() -> dict[str, tuple[bool, float]]:
    """Kernel module -> (built, seconds), building each once (a cached build loads)."""
    built = {}
    for name in KERNELS:
        module = importlib.import_module(name)  # torch's import is not the kernel's time
        start = time.monotonic()
        built[name] = (module.load() is not None, time.monotonic() - start)
    return built


def run(args: argparse.Namespace) -> int:
    if args.prebuilt:
        return prebuild_all(args.prebuilt)
    if args.check:
        return check_all()
    built = build_all()
    for name, (ok, seconds) in built.items():
        target = getattr(importlib.import_module(name).load(), "batchpilot_target", "")
        state = f"ready ({target})" if ok else "unavailable, torch serves instead"
        print(f"{name.rsplit('.', 1)[-1]:<11} {state:<34} {seconds:6.1f} s  {KERNELS[name]}")
    return 0  # an unavailable kernel is not an error: the torch path is always correct


def prebuild_all(root: Path) -> int:
    """Every kernel for each of its targets into root; a build failure is an error here."""
    for kernel in specs().values():
        start = time.monotonic()
        done = prebuilt_kernels.prebuild(kernel, root)
        states = ", ".join(f"{target} {state}" for target, state in done.items())
        print(f"{kernel.stem:<11} {states}  {time.monotonic() - start:6.1f} s", flush=True)
    return 0


def check_all() -> int:
    root = prebuilt_kernels.directory()
    if root is None:
        print(f"${prebuilt_kernels.ENV} is not set")
        return 1
    flags = cpu_flags()
    failed = [why for kernel in specs().values()
              if (why := prebuilt_kernels.check(kernel, flags, root))]  # fmt: skip
    for kernel in specs().values():
        found = prebuilt_kernels.entry(kernel, root, flags)
        print(f"{kernel.stem:<11} {found[0].label if isinstance(found, tuple) else found}")
    for why in failed:
        print(f"FAILED {why}")
    return 1 if failed else 0
