"""One engine's decode step at batch 32 (bundled model, dtype auto): admit 32 prompts,
then time 10 steps and print the median. Run it under different `taskset` pinnings to
see what the thread count costs on a loaded machine, e.g.
`taskset -c 1 .venv/bin/python benchmarks/decode_step.py`."""

import os
import statistics
import time

import torch

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.bench.workload import make_workload

engine = LLM(None, dtype="auto", max_num_seqs=32, max_model_len=2048).engine
print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
for i, request in enumerate(make_workload(32, 0, (128,))):
    engine.add_request(str(i), request.prompt, params)
start, admitting = time.perf_counter(), 0
while engine.stats().last_step_batch_size < 32 or admitting < 3:
    engine.step()
    admitting += 1
print(f"admitting 32 prompts: {admitting} steps, {time.perf_counter() - start:.1f} s")
times = []
for _ in range(10):
    start = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - start)
print(
    f"step at batch {engine.stats().last_step_batch_size}: median {statistics.median(times) * 1e3:.0f} ms"
)
