"""Which side is wrong when the Triton engine's greedy tokens differ from the torch
engine's on a GPU: the same prompt through torch, triton, triton with a 1 GiB KV cache,
and transformers (bf16 and fp32); plus the kernels at SmolLM2's head shape."""

import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchpilot.server import LLM, SamplingParams
from batchpilot.server.model.loader import resolve_source

dev = "cuda" if torch.cuda.is_available() else "cpu"
N = int(os.environ.get("PROBE_TOKENS", "16"))
path = resolve_source(None)[0]
gen = torch.Generator().manual_seed(0)
vocab = AutoTokenizer.from_pretrained(path).vocab_size
prompts = [torch.randint(vocab, (256,), generator=gen).tolist() for _ in range(4)]
params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
res = {}
cases = [
    ("torch", dict(attention_backend="torch")),
    ("triton", dict(attention_backend="triton")),
    ("triton 1GiB", dict(attention_backend="triton", kv_cache_memory_bytes=1 << 30)),
    ("graphs", dict(attention_backend="triton", cuda_graphs=True)),
]
for label, kw in cases:
    t = time.time()
    llm = LLM(
        None,
        dtype="bfloat16",
        max_model_len=300,
        enable_prefix_caching=False,
        max_num_seqs=4,
        **({"gpu_memory_utilization": 0.6} | kw if dev == "cuda" else kw),
    )
    print(label, "blocks", llm.stats().num_kv_blocks, flush=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res[label] = [list(o.outputs[0].token_ids) for o in outs]
    print(label, round(time.time() - t, 1), res[label][0], flush=True)
    del llm
    torch.cuda.empty_cache() if dev == "cuda" else None
for dt in (torch.bfloat16, torch.float32):
    m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dt).to(dev)
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        g = m.generate(ids, max_new_tokens=N, do_sample=False, min_new_tokens=N)
        outs.append(g[0, 256:].tolist())
    res[f"hf {str(dt)[6:]}"] = outs
    print(f"hf {dt}", outs[0], flush=True)
    del m


def lead(x, y):
    return next((k for k in range(N) if x[k] != y[k]), N)


for ref in ("hf float32", "hf bfloat16", "torch", "triton"):
    for a in res:
        print(
            f"{a:>12} vs {ref:>11}: leading equal tokens per prompt",
            [lead(x, y) for x, y in zip(res[a], res[ref], strict=False)],
        )
if dev == "cuda" and os.environ.get("PROBE_KERNELS"):
    from batchpilot.server.bench import gpu

    gpu.HEADS, gpu.KV_HEADS, gpu.HEAD_DIM = 9, 3, 64
    bw = gpu.copy_bandwidth()
    for r in (
        gpu.write_row("auto", bw),
        gpu.decode_row("auto", bw, [257 + i for i in range(4)], "4 seqs"),
        gpu.decode_row("auto", bw, [8192, 8000, 7000, 6001], "4 seqs x 8k"),
        gpu.extend_row("auto", bw),
    ):
        print("kernel at 9/3/64:", r.get("kernel"), r.get("case"), r.get("check"))
