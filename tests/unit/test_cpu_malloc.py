"""glibc's malloc tuned for a CPU engine: the sampler's allocations of megabytes, repeated
every step, reuse their pages instead of faulting them in again; whoever set glibc's own
environment knobs keeps them. Each case runs in a fresh interpreter, because mallopt
changes the whole process."""

import os
import subprocess
import sys

# One decode step's sampler at 40 rows of the bundled model's vocabulary, 20 times:
# prints whether the tuning applied, then the minor page faults of the second 20.
STEPS = """
import resource, sys, torch
from batchpilot.server.cpu_malloc import keep_freed_memory
print(keep_freed_memory() if sys.argv[1] == "tune" else "untuned")
logits = torch.randn(40, 49152)
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        probs = (logits / 0.7).softmax(dim=-1)
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        del probs, cdf
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(faults())
"""


def run_steps(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", STEPS, mode], env={**clean, **env},
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    applied, faults = done.stdout.split()
    return applied, int(faults)


def test_tuned_malloc_reuses_the_pages_that_glibc_unmaps_by_default():
    untuned, default_faults = run_steps("plain")
    applied, tuned_faults = run_steps("tune")
    assert (untuned, applied) == ("untuned", "True")
    # 20 steps each allocate and free ~40 MiB: ~10,000 pages a step by default.
    assert default_faults > 20 * 1_000
    assert tuned_faults < 20 * 10


def test_the_environments_own_malloc_knobs_are_left_alone():
    applied, faults = run_steps("tune", MALLOC_TOP_PAD_="0")
    assert applied == "False"
    assert faults > 20 * 1_000  # the environment's choice stands: pages fault again
