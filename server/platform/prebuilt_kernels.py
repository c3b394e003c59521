"""The C++ CPU kernels prebuilt for named CPU targets, for machines without a compiler.

`-march=native` (cpu_kernels' build on first use) makes code for the CPU that compiles it:
it cannot ship in an image built on one machine and run on another. So `batchpilot kernels
--prebuilt DIR` builds every kernel once per target of its own (`Kernel.targets`, the best
first) into DIR with a manifest, and the server image carries DIR
($BATCHPILOT_KERNELS_DIR). At run time `load()` takes the best target whose instructions
this CPU's /proc/cpuinfo flags all list, and imports that shared object as a plain
extension module: no compiler, no ninja. A target this CPU lacks is never loaded (it could
die of SIGILL); a build for another torch or another source is never loaded either (the
manifest records both)."""

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

log = logging.getLogger("batchpilot.engine")

ENV = "BATCHPILOT_KERNELS_DIR"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Target:
    """A named level of x86-64: the compiler's flags and the /proc/cpuinfo flags a CPU
    must list to run what they produce."""

    name: str  # a C identifier: the module name carries it (PyInit_<name>)
    label: str
    cflags: tuple[str, ...]
    needs: frozenset[str]


# The psABI levels, as /proc/cpuinfo spells them (abm is LZCNT, pni SSE3).
V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
V3 = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_ALL = (
    # cpu_gemv's vdpbf16ps: Intel Cooper Lake and Sapphire Rapids on, AMD Zen 4 on.
    Target(
        "x86_64_v4_bf16",
        "x86-64-v4+avx512bf16",
        ("-march=x86-64-v4", "-mavx512bf16"),
        V4 | {"avx512_bf16"},
    ),
    Target("x86_64_v4", "x86-64-v4 (AVX-512)", ("-march=x86-64-v4",), V4),
    Target("x86_64_v3", "x86-64-v3 (AVX2, FMA)", ("-march=x86-64-v3",), V3),
)
TARGETS = {t.name: t for t in _ALL}
# The auto-vectorized kernels (no intrinsics): GCC makes nothing of AVX512-BF16 or AMX from
# their plain C++ loops, so AVX-512 is their best level and AVX2 + FMA covers older CPUs.
PORTABLE = ("x86_64_v4", "x86_64_v3")
BF16 = ("x86_64_v4_bf16",)


@dataclass(frozen=True)
class Kernel:
    """One C++ kernel: its source, the one function it exports, and how it builds. cflags
    carry no -march: the native build adds -march=native, a prebuilt one its target's."""

    stem: str
    source: str
    function: str
    what: str
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    targets: tuple[str, ...] = PORTABLE

    def module_name(self, target: Target) -> str:
        return f"batchpilot_{self.stem}_{target.name}"

    def digest(self, target: Target) -> str:
        """The build's identity: source and every flag (a manifest entry must match it)."""
        parts = [self.source, *self.cflags, "|", *self.ldflags, "|", *target.cflags]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def supported(target: Target, flags: set[str]) -> bool:
    return target.needs <= flags


def best(names: tuple[str, ...], flags: set[str]) -> Target | None:
    """The first of names (best first) that a CPU with these flags runs; None if none."""
    return next((TARGETS[n] for n in names if supported(TARGETS[n], flags)), None)


def torch_identity() -> dict[str, str]:
    """What a prebuilt module's ABI depends on: the exact torch build it compiled against."""
    import torch

    return {"version": torch.__version__, "git": torch.version.git_version}


def directory() -> Path | None:
    """$BATCHPILOT_KERNELS_DIR (the server image sets it), or None."""
    return Path(os.environ[ENV]) if os.environ.get(ENV) else None


def read_manifest(root: Path) -> dict:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def entry(kernel: Kernel, root: Path, flags: set[str]) -> tuple[Target, Path] | str:
    """(the target to load, its file) from root's manifest, or why there is none."""
    manifest = read_manifest(root)
    if not manifest:
        return f"no readable {root / MANIFEST}"
    if manifest.get("torch") != torch_identity():
        return f"built for torch {manifest.get('torch')}, not this one"
    built = manifest.get("kernels", {}).get(kernel.stem, {})
    current = [n for n in kernel.targets if built.get(n, {}).get("digest") ==
               kernel.digest(TARGETS[n])]  # fmt: skip
    if not current:
        return "none built from this source"
    target = best(tuple(current), flags)
    if target is None:
        lacking = sorted(TARGETS[current[-1]].needs - flags)
        return f"this CPU lacks {' '.join(lacking)} (built for {', '.join(current)})"
    return target, root / built[target.name]["file"]


def load(kernel: Kernel, flags: set[str], root: Path | None = None):
    """The kernel's prebuilt module for the best target this CPU runs, or None (logged)."""
    root = root or directory()
    if root is None:
        return None
    found = entry(kernel, root, flags)
    if isinstance(found, str):
        log.info("CPU %s kernel: no prebuilt build in %s fits: %s", kernel.what, root, found)
        return None
    target, path = found
    try:
        module = import_extension(kernel.module_name(target), path)
    except Exception as exc:  # an unreadable file, an undefined symbol: the others still serve
        log.warning("CPU %s kernel: cannot load the prebuilt %s: %s", kernel.what, path, exc)
        return None
    module.batchpilot_target = target.label
    log.info("CPU %s kernel: prebuilt for %s", kernel.what, target.label)
    return module


def import_extension(name: str, path: Path):
    """A compiled extension module imported from its file, with no compiler involved (torch
    first: the module links against its libraries, which only torch's import loads)."""
    import torch  # noqa: F401

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not an extension module: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prebuild(kernel: Kernel, root: Path) -> dict[str, str]:
    """Build kernel for each of its targets into root (kept where the manifest shows the
    same source, flags and torch) and record it there -> target -> "built" or "kept"."""
    done = {}
    for name in kernel.targets:
        target = TARGETS[name]
        manifest = read_manifest(root)
        old = manifest.get("kernels", {}).get(kernel.stem, {}).get(name, {})
        file = f"{kernel.module_name(target)}.so"
        same = manifest.get("torch") == torch_identity() and (root / file).is_file()
        if same and old.get("digest") == kernel.digest(target):
            done[name] = "kept"
            continue
        compile_to(kernel, target, root / file)
        record(root, kernel.stem, name, {"file": file, "digest": kernel.digest(target)})
        done[name] = "built"
    return done


def compile_to(kernel: Kernel, target: Target, out: Path) -> None:
    """torch's own inline build (its flags, its pybind11 module definition) for target,
    without importing the result: this machine may lack the target's instructions."""
    from torch.utils import cpp_extension

    name = kernel.module_name(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as build_dir:
        # torch builds a name only once per process unless its inputs change: forget it.
        cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
        no_import = mock.patch.object(cpp_extension, "_import_module_from_library")
        with no_import:
            cpp_extension.load_inline(
                name, cpp_sources=kernel.source, functions=[kernel.function],
                extra_cflags=[*kernel.cflags, *target.cflags],
                extra_ldflags=list(kernel.ldflags), build_directory=build_dir,
            )  # fmt: skip
        built = Path(build_dir) / f"{name}{cpp_extension.LIB_EXT}"
        if not built.is_file():
            raise RuntimeError(f"torch's build left no {built.name}")
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        shutil.copyfile(built, tmp)
        os.replace(tmp, out)


def record(root: Path, stem: str, target: str, item: dict) -> None:
    """One built target into root's manifest (reset when it was for another torch)."""
    manifest = read_manifest(root)
    if manifest.get("torch") != torch_identity():
        manifest = {"torch": torch_identity(), "kernels": {}}
    manifest["kernels"].setdefault(stem, {})[target] = item
    tmp = root / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, root / MANIFEST)


def check(kernel: Kernel, flags: set[str], root: Path) -> str | None:
    """Why the prebuilt kernel does not load on a CPU that runs one of its targets (a
    missing or broken build: the image build stops on it); None where it loads, or where
    this CPU runs none of its targets."""
    if best(kernel.targets, flags) is None:
        return None
    found = entry(kernel, root, flags)
    if isinstance(found, str):
        return f"{kernel.stem}: {found}"
    target, path = found
    try:
        import_extension(kernel.module_name(target), path)
    except Exception as exc:  # reported, not raised: every kernel is checked
        return f"{kernel.stem}: {path}: {exc}"
    return None
