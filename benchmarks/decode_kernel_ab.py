"""The CPU decode attention kernel on and off, interleaved step by step in one engine at
batch 32 (bundled model, dtype auto), so that a shared machine's drifting load hits both
alike. Run pinned, e.g. `taskset -c 0 .venv/bin/python benchmarks/decode_kernel_ab.py`."""

import statistics
import time

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.attention import cpu_decode
from batchpilot.server.bench.workload import make_workload

kernel_usable = cpu_decode.usable
engine = LLM(None, dtype="auto", max_num_seqs=32, max_model_len=2048).engine
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
for i, request in enumerate(make_workload(32, 0, (128,))):
    engine.add_request(str(i), request.prompt, params)
for _ in range(5):  # past admission, into steady decoding
    engine.step()
times = {True: [], False: []}
for i in range(40):
    on = i % 2 == 0
    cpu_decode.usable = kernel_usable if on else (lambda kv, q: False)
    start = time.perf_counter()
    engine.step()
    times[on].append(time.perf_counter() - start)
print(f"batch {engine.stats().last_step_batch_size}")
for on in (False, True):
    median, best = statistics.median(times[on]) * 1e3, min(times[on]) * 1e3
    print(f"kernel {'on' if on else 'off'}: step median {median:.0f} ms, min {best:.0f} ms")
