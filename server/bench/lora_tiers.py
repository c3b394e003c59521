"""`batchpilot bench lora-tiers`: adapters beyond the slots. 16 PEFT adapters are
registered over max_loras 4 device slots and max_cpu_loras 8 in host memory, so both
tiers evict; a burst of requests picks its adapters uniformly or by Zipf popularity.
Reported per popularity: throughput ÷ the same requests on the base model, and the P90
time to first token of both (the burst arrives at once, so TTFT includes the wait for a
slot, a host read or the batch).

The adapters are made here with PEFT (lora.py's make_adapters), so nothing downloads.
Every request gets a distinct first token, and every burst starts with the prefix cache
reset: the bursts repeat the same prompts, and the base model's blocks stayed cached from
one burst to the next while an adapter read again starts a new chain, which favoured the
base run (its later bursts skipped their prefills).
The LoRA and base runs alternate `--repeats` times in one engine and the median of each
is reported: a shared machine's noise then falls on both."""

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from batchpilot.server.bench.lora import make_adapters
from batchpilot.server.bench.machine import describe
from batchpilot.server.bench.report import save_json, table
from batchpilot.server.bench.workload import seed_prompt

ZIPF_EXPONENT = 1.0  # P(k-th most popular) ∝ 1/k: a few adapters take most requests
SETTINGS = ("dtype", "num_adapters", "max_loras", "max_cpu_loras", "rank", "num_requests",
            "output_len", "repeats", "seed")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: bundled)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--num-adapters", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--max-cpu-loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", type=Path, default=Path("bench-results"))


def popularity(kind: str, names: list[str], count: int, seed: int) -> list[str]:
    """count adapter names drawn uniformly or by Zipf's law (fixed by seed)."""
    rng = random.Random(seed)
    if kind == "uniform":
        return [rng.choice(names) for _ in range(count)]
    weights = [1 / (k + 1) ** ZIPF_EXPONENT for k in range(len(names))]
    return rng.choices(names, weights, k=count)


def burst(llm, prompts: list[list[int]], loras: list, output_len: int) -> dict:
    """One burst -> its tok/s, P90 TTFT (s), and the requests that did not complete."""
    from batchpilot.server import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora=loras)
    elapsed = time.perf_counter() - start
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / elapsed, "p90_ttft_s": statistics.quantiles(ttfts, n=10)[-1],
            "failed": sum(o.outputs[0].finish_reason != "length" for o in outs)}  # fmt: skip


def count_loads(llm) -> list[str]:
    """The host reads and device slot writes from now on, by counting their calls."""
    counts: list[str] = []
    reader, slots = llm.engine.loras.reader, llm.engine.runner.lora_slots
    start, write = reader.start, slots._write
    reader.start = lambda name, path: counts.append("read") or start(name, path)
    slots._write = lambda slot, adapter: counts.append("write") or write(slot, adapter)
    return counts


def measure(args, llm, names: list[str], kind: str, loads: list[str]) -> dict:
    """Alternate base and LoRA bursts; loads: count_loads's list (its new entries count)."""
    ids = llm.get_tokenizer()(seed_prompt(4))["input_ids"]
    vocab = llm.engine.vocab_size
    prompts = [[(ids[0] + i) % vocab, *ids[1:]] for i in range(args.num_requests)]
    loras = popularity(kind, names, args.num_requests, args.seed)
    before = len(loads)
    runs: dict[str, list[dict]] = {"base": [], "lora": []}
    for _ in range(args.repeats):
        runs["base"].append(burst(llm, prompts, [None] * len(prompts), args.output_len))
        runs["lora"].append(burst(llm, prompts, loras, args.output_len))
    counts = loads[before:]
    median = {run: {key: statistics.median(r[key] for r in results) for key in results[0]}
              for run, results in runs.items()}  # fmt: skip
    return {
        "popularity": kind,
        "distinct_adapters": len(set(loras)),
        "requests_of_top_adapter": max(loras.count(n) for n in set(loras)),
        "base": median["base"],
        "lora": median["lora"],
        "throughput_ratio": median["lora"]["tok_s"] / median["base"]["tok_s"],
        "host_reads_per_burst": counts.count("read") / args.repeats,
        "slot_writes_per_burst": counts.count("write") / args.repeats,
        "runs": runs,
    }


def engine(args, base: str, root: Path):
    from batchpilot.server import LLM

    llm = LLM(args.model, dtype=args.dtype, enable_lora=True, max_loras=args.max_loras,
              max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.rank)  # fmt: skip
    names = [f"adapter-{i}" for i in range(args.num_adapters)]
    paths = make_adapters(base, args.rank, root, args.num_adapters)
    for name, path in zip(names, paths, strict=True):
        llm.add_lora(name, path)
    return llm, names


def run(args: argparse.Namespace) -> int:
    from batchpilot.server.model.loader import resolve_source

    base = resolve_source(args.model)[0]
    with tempfile.TemporaryDirectory(prefix="bench-lora-tiers-") as tmp:
        llm, names = engine(args, base, Path(tmp))
        burst(llm, [[1, 2, 3]] * 4, names[:4], 4)  # warm-up: first calls, slot copies
        loads = count_loads(llm)
        results = []
        for kind in ("uniform", "zipf"):
            print(f"{kind} ...", flush=True)
            results.append(measure(args, llm, names, kind, loads))
    rows = [[r["popularity"], f"{r['base']['tok_s']:.1f}", f"{r['lora']['tok_s']:.1f}",
             f"{r['throughput_ratio']:.2f}", f"{r['base']['p90_ttft_s']:.2f}",
             f"{r['lora']['p90_ttft_s']:.2f}", f"{r['host_reads_per_burst']:.0f}"]
            for r in results]  # fmt: skip
    print(table(["popularity", "base tok/s", "LoRA tok/s", "LoRA / base", "base P90 TTFT s",
                 "LoRA P90 TTFT s", "host reads"], rows))  # fmt: skip
    dtype = llm.engine.runner.model.lm_head.weight.dtype
    out = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "model": args.model or "bundled SmolLM2-135M-Instruct",
        "settings": {key: getattr(args, key) for key in SETTINGS},
        "machine": describe(dtype),
        "popularities": results,
    }
    save_json(out, args.result_dir, f"lora-tiers-{out['date']}.json")
    return 0
