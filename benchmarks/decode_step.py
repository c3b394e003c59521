"""One engine's decode step (bundled model, dtype auto): admit the seed's prompts, then time
15 steps (on the attention path the start-up timing chose) and print the median.
`--temperature 0.7 --batch 40` is the seed's load script; `--kernel-ab` times 40 steps
with the CPU decode kernel on and off in turn, whatever start-up chose, so a shared
machine's drifting load hits both alike; `--rope-ab` does the same for the fused rotary +
K/V write (server/model/cpu_rope.py) against torch's ops, and `--fused-ab` the fused decode
step (server/model/cpu_layer.py: the layers in one C++ call) against the layer-by-layer one. Run it under different `taskset` pinnings to see
what the thread count costs on a loaded machine, e.g.
`taskset -c 1 .venv/bin/python benchmarks/decode_step.py`. `--no-malloc-tuning` leaves
glibc's malloc as it comes (server/platform/cpu_malloc.py), for an A/B of its page faults."""

import argparse
import os
import random
import resource
import statistics
import time

import torch

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.bench.workload import SEED_REPEATS, seed_prompt
from batchpilot.server.model import cpu_rope

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--temperature", type=float, default=0.0)
parser.add_argument("--kernel-ab", action="store_true")
parser.add_argument("--rope-ab", action="store_true")
parser.add_argument("--fused-ab", action="store_true")
parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
parser.add_argument("--linear-backend", default="auto", choices=("auto", "torch", "onednn"))
parser.add_argument("--no-malloc-tuning", action="store_true")
args = parser.parse_args()
if args.no_malloc_tuning:
    import batchpilot.server.platform.prepare

    batchpilot.server.platform.prepare.keep_freed_memory = lambda: False

engine = LLM(None, dtype=args.dtype, max_num_seqs=max(64, args.batch), max_model_len=2048,
             linear_backend=args.linear_backend).engine  # fmt: skip
print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}, "
      f"linear {engine.runner.linear_backend}")  # fmt: skip
rng = random.Random(0)
for i in range(args.batch):
    params = SamplingParams(max_tokens=128, temperature=args.temperature, ignore_eos=True, seed=i)
    engine.add_request(str(i), seed_prompt(rng.choice(SEED_REPEATS)), params)
start, admitting = time.perf_counter(), 0
while engine.stats().last_step_batch_size < args.batch or admitting < 3:
    engine.step()
    admitting += 1
print(f"admitting {args.batch} prompts: {admitting} steps, {time.perf_counter() - start:.1f} s")

chosen = engine.runner.attention_backend
print(f"start-up chose {chosen}")
ab = args.kernel_ab or args.rope_ab or args.fused_ab
modes = [True, False] * 20 if ab else [chosen == "cpu_kernel"] * 15
fused_rope, fused_step = cpu_rope.usable, engine.runner.fused
print(f"fused decode step: {'built' if fused_step else 'not used (needs bf16 GEMV kernel)'}")
what = "rotary + write" if args.rope_ab else "fused step" if args.fused_ab else "decode"
times = {True: [], False: []}
faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for on in modes:
    if args.rope_ab:
        cpu_rope.usable = fused_rope if on else lambda *_: False
    elif args.fused_ab:
        engine.runner.fused = fused_step if on else None
    else:
        engine.runner.attention_backend = "cpu_kernel" if on else "torch"
    start = time.perf_counter()
    engine.step()
    times[on].append(time.perf_counter() - start)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before) / len(modes)
batch = engine.stats().last_step_batch_size
print(f"minor page faults per step: {faults:.0f}")
for on, taken in times.items():
    if taken:
        print(f"step at batch {batch}, temperature {args.temperature}, "
              f"{what} {'on' if on else 'off'}: median {statistics.median(taken) * 1e3:.1f} ms, "
              f"min {min(taken) * 1e3:.1f} ms")  # fmt: skip
