"""Where a decode step's time goes: torch profiler over 20 engine steps of the offline
workload at 32 running sequences (bundled model, bfloat16). Writes the operator table
to benchmarks/results/profile-decode.txt. Run: .venv/bin/python benchmarks/profile_decode.py"""

import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.bench.workload import make_workload

llm = LLM(None, dtype="bfloat16", max_num_seqs=32, max_model_len=2048)
engine = llm.engine
for i, request in enumerate(make_workload(64, 0)):
    params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
    engine.add_request(str(i), request.prompt, params)
for _ in range(20):  # past the first prefills, into steady decoding
    engine.step()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    start = time.perf_counter()
    for _ in range(20):
        engine.step()
    step_ms = (time.perf_counter() - start) / 20 * 1e3
table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
header = f"20 engine steps, {engine.stats().last_step_batch_size} sequences in the last, {step_ms:.1f} ms/step\n"
out = Path(__file__).parent / "results" / "profile-decode.txt"
out.write_text(header + table)
print(header + table)
