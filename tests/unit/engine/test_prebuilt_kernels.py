"""Prebuilt CPU kernels: the best named target this CPU's flags run (never one it lacks),
a manifest that must match the torch and the source, and a prebuilt module that loads
with no compiler and no ninja on the PATH."""

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from batchpilot.cli import main
from batchpilot.server.platform import cpu_kernels, prebuilt_kernels
from batchpilot.server.platform.cpuinfo import cpu_flags
from batchpilot.server.platform.prebuilt_kernels import BF16, PORTABLE, V2, V3, V4, Kernel

# Flags as /proc/cpuinfo lists them: a Sapphire Rapids Xeon, an AVX2-only EPYC (Zen 2),
# an old x86-64-v2 CPU, and a v4 CPU whose AVX-512 the kernel has turned off (no avx512vl).
SAPPHIRE = V4 | {"avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "sse", "sse2"}
ZEN2 = V3 | {"sse", "sse2", "sha_ni"}
OLD = V2 | {"sse", "sse2"}
NO_VL = V4 - {"avx512vl"}

TINY = Kernel("test_twice", "torch::Tensor twice(torch::Tensor x) { return x * 2; }",
              "twice", "test", ("-O1",), targets=("x86_64_v3",))  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "portable", "bf16"),
    [
        (SAPPHIRE, "x86_64_v4", "x86_64_v4_bf16"),
        (ZEN2, "x86_64_v3", None),
        (NO_VL, "x86_64_v3", None),
        (OLD, None, None),
        (set(), None, None),
    ],
)
def test_the_best_target_is_the_first_whose_flags_this_cpu_lists(flags, portable, bf16):
    for names, expected in ((PORTABLE, portable), (BF16, bf16)):
        target = prebuilt_kernels.best(names, set(flags))
        assert (target.name if target else None) == expected


def test_a_target_needs_every_flag_its_march_level_implies():
    v4 = prebuilt_kernels.TARGETS["x86_64_v4"]
    assert prebuilt_kernels.supported(v4, set(V4))
    for flag in V4:
        assert not prebuilt_kernels.supported(v4, set(V4) - {flag}), flag
    bf16 = prebuilt_kernels.TARGETS["x86_64_v4_bf16"]
    assert "-mavx512bf16" in bf16.cflags and "avx512_bf16" in bf16.needs


def fake_prebuilt(root: Path, kernel: Kernel, targets: tuple[str, ...], torch_id=None) -> None:
    """A manifest listing kernel at targets, each file a stand-in (nothing is compiled)."""
    built = {}
    for name in targets:
        target = prebuilt_kernels.TARGETS[name]
        file = f"{kernel.module_name(target)}.so"
        (root / file).write_bytes(b"not a shared object")
        built[name] = {"file": file, "digest": kernel.digest(target)}
    manifest = {"torch": torch_id or prebuilt_kernels.torch_identity(),
                "kernels": {kernel.stem: built}}  # fmt: skip
    (root / prebuilt_kernels.MANIFEST).write_text(json.dumps(manifest))


def portable_kernel(source: str = "int f() { return 1; }") -> Kernel:
    return Kernel("test_k", source, "f", "test", ("-O3",), targets=PORTABLE)


def test_the_manifest_entry_for_the_best_runnable_target_is_chosen(tmp_path):
    kernel = portable_kernel()
    fake_prebuilt(tmp_path, kernel, PORTABLE)
    target, path = prebuilt_kernels.entry(kernel, tmp_path, set(SAPPHIRE))
    assert target.name == "x86_64_v4" and path == tmp_path / "batchpilot_test_k_x86_64_v4.so"
    target, _ = prebuilt_kernels.entry(kernel, tmp_path, set(ZEN2))
    assert target.name == "x86_64_v3"


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("cpu lacks", "this CPU lacks"),
        ("other torch", "not this one"),
        ("other source", "none built from this source"),
        ("no manifest", "no readable"),
    ],
)
def test_a_prebuilt_kernel_that_does_not_fit_is_never_imported(
    tmp_path, monkeypatch, caplog, case, reason
):
    kernel = portable_kernel()
    if case != "no manifest":
        other = {"version": "0.0.1", "git": "x"} if case == "other torch" else None
        fake_prebuilt(tmp_path, portable_kernel("int f() { return 2; }")
                      if case == "other source" else kernel, ("x86_64_v4",), other)  # fmt: skip

    def never(*args):
        raise AssertionError("imported a prebuilt kernel that does not fit")

    monkeypatch.setattr(prebuilt_kernels, "import_extension", never)
    caplog.set_level("INFO", logger="batchpilot.engine")
    assert prebuilt_kernels.load(kernel, set(ZEN2), tmp_path) is None
    assert reason in caplog.text


def test_an_unloadable_prebuilt_file_falls_back_with_a_warning(tmp_path, caplog):
    kernel = portable_kernel()
    fake_prebuilt(tmp_path, kernel, PORTABLE)  # files that are not shared objects
    assert prebuilt_kernels.load(kernel, set(SAPPHIRE), tmp_path) is None
    assert "cannot load the prebuilt" in caplog.text


def test_without_a_prebuilt_directory_nothing_is_looked_up(monkeypatch):
    monkeypatch.delenv(prebuilt_kernels.ENV, raising=False)
    assert prebuilt_kernels.load(portable_kernel(), set(SAPPHIRE)) is None


def test_a_kernel_takes_its_prebuilt_module_first_and_builds_natively_only_without_one(
    monkeypatch,
):
    prebuilt, native = object(), object()
    monkeypatch.setattr(cpu_kernels, "build_native", lambda kernel: native)
    monkeypatch.setattr(prebuilt_kernels, "load", lambda kernel, flags: prebuilt)
    assert cpu_kernels.build(portable_kernel()) is prebuilt
    monkeypatch.setattr(prebuilt_kernels, "load", lambda kernel, flags: None)
    assert cpu_kernels.build(portable_kernel()) is native


def test_every_kernel_declares_targets_it_can_be_built_for():
    specs = cpu_kernels.specs()
    assert set(specs) == set(cpu_kernels.KERNELS)
    for kernel in specs.values():
        assert kernel.targets and set(kernel.targets) <= set(prebuilt_kernels.TARGETS)
        assert not any(flag.startswith("-march") for flag in kernel.cflags), kernel.stem
    assert specs["batchpilot.server.model.cpu_gemv"].targets == BF16
    assert specs["batchpilot.server.model.cpu_layer"].targets == BF16


def test_the_check_fails_where_a_runnable_prebuilt_kernel_does_not_load(
    tmp_path, monkeypatch, capsys
):
    kernel = portable_kernel()
    monkeypatch.setattr(cpu_kernels, "specs", lambda: {"k": kernel})
    monkeypatch.setenv(prebuilt_kernels.ENV, str(tmp_path))
    fake_prebuilt(tmp_path, kernel, PORTABLE)  # broken files
    assert main(["kernels", "--check"]) == 1
    assert "FAILED test_k" in capsys.readouterr().out
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: set(OLD))  # nothing it could run
    assert main(["kernels", "--check"]) == 0


LOAD_WITHOUT_A_COMPILER = """
import json, shutil, sys
from pathlib import Path
assert not any(shutil.which(tool) for tool in ("g++", "c++", "gcc", "cc", "ninja"))
import torch
from batchpilot.server.platform import prebuilt_kernels
spec = json.loads(sys.argv[1])
kernel = prebuilt_kernels.Kernel(**{k: tuple(v) if isinstance(v, list) else v
                                    for k, v in spec.items()})
module = prebuilt_kernels.load(kernel, set(prebuilt_kernels.V3), Path(sys.argv[2]))
print(json.dumps({"target": module.batchpilot_target, "twice": module.twice(torch.arange(3)).tolist(),
                  "cpp_extension": "torch.utils.cpp_extension" in sys.modules}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not cpu_flags() >= V3, reason="this CPU cannot run x86-64-v3 code")
def test_a_prebuilt_kernel_loads_in_a_process_with_no_compiler_and_no_ninja(tmp_path):
    root = tmp_path / "kernels"
    assert prebuilt_kernels.prebuild(TINY, root) == {"x86_64_v3": "built"}
    assert prebuilt_kernels.prebuild(TINY, root) == {"x86_64_v3": "kept"}
    empty = tmp_path / "bin"
    empty.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_A_COMPILER, json.dumps(asdict(TINY)), str(root)],
        env={"PATH": str(empty), "HOME": str(tmp_path)}, cwd=tmp_path,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert got == {"target": "x86-64-v3 (AVX2, FMA)", "twice": [0, 2, 4], "cpp_extension": False}
    assert torch.__version__ in (root / prebuilt_kernels.MANIFEST).read_text()
