"""The Triton kernels compile for Hopper (sm90, the H100/H200 the operator schedules on)
in their serving configurations, without a GPU: tests/unit/engine/triton_aot.py runs
Triton's compiler and ptxas on the CPU, in a subprocess because this process's kernels
are the interpreter's."""

import os
import subprocess
import sys
from pathlib import Path

AOT = Path(__file__).with_name("triton_aot.py")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while the default is unset
    done = subprocess.run([sys.executable, str(AOT), "90"], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ok ") == 9  # per dtype: 2 decode, extend, write; one merge
