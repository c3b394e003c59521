"""`batchpilot bench lora`: throughput of one batch that mixes 4 adapters and the base
model against the base model alone, side by side in one engine and one run, per rank.

The adapters are made here with PEFT (random, non-zero weights over every projection),
so nothing downloads. Every request gets a distinct first token, so prefix caching
(which never shares blocks across adapters) cannot favour the base-only batch. The two
batches alternate `--repeats` times and the median of each is reported: a shared
machine's noise then falls on both."""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from batchpilot.server.bench.machine import describe
from batchpilot.server.bench.report import save_json, table
from batchpilot.server.bench.workload import parse_int_list, seed_prompt

NUM_ADAPTERS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: bundled)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--ranks", type=parse_int_list, default=(8, 16))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--result-dir", type=Path, default=Path("bench-results"))


def make_adapters(base: str, rank: int, root: Path, count: int = NUM_ADAPTERS) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True,
                                                     dtype=torch.float32)  # fmt: skip
        torch.manual_seed(i)
        config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj"])  # fmt: skip
        path = root / f"rank{rank}-{i}"
        get_peft_model(model, config).save_pretrained(path)
        paths.append(str(path))
    return paths


def tokens_per_second(llm, prompts: list[list[int]], loras: list[str | None], output_len: int):
    from batchpilot.server import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def measure_rank(args, base: str, rank: int, root: Path) -> dict:
    from batchpilot.server import LLM

    llm = LLM(args.model, dtype=args.dtype, enable_lora=True, max_loras=NUM_ADAPTERS,
              max_lora_rank=rank, max_num_seqs=args.num_requests)  # fmt: skip
    names = []
    for i, path in enumerate(make_adapters(base, rank, root)):
        llm.add_lora(f"adapter-{i}", path)
        names.append(f"adapter-{i}")
    ids = llm.get_tokenizer()(seed_prompt(4))["input_ids"]
    vocab = llm.engine.vocab_size
    prompts = [[(ids[0] + i) % vocab, *ids[1:]] for i in range(args.num_requests)]
    mixed = [([None, *names])[i % (NUM_ADAPTERS + 1)] for i in range(args.num_requests)]
    base_only = [None] * args.num_requests
    tokens_per_second(llm, prompts[:4], mixed[:4], 4)  # warm-up: first calls, slot copies
    runs = {"base": [], "mixed": []}
    for _ in range(args.repeats):
        runs["base"].append(tokens_per_second(llm, prompts, base_only, args.output_len))
        runs["mixed"].append(tokens_per_second(llm, prompts, mixed, args.output_len))
    base_tps, mixed_tps = statistics.median(runs["base"]), statistics.median(runs["mixed"])
    dtype = str(llm.engine.runner.model.lm_head.weight.dtype).removeprefix("torch.")
    return {"rank": rank, "dtype": dtype, "base_tok_s": base_tps, "mixed_tok_s": mixed_tps,
            "ratio": mixed_tps / base_tps, "runs": runs}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from batchpilot.server.model.loader import resolve_source

    base = resolve_source(args.model)[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        for rank in args.ranks:
            print(f"rank {rank} ...", flush=True)
            results.append(measure_rank(args, base, rank, Path(tmp)))
    rows = [[str(r["rank"]), f"{r['base_tok_s']:.1f}", f"{r['mixed_tok_s']:.1f}", f"{r['ratio']:.2f}"]
            for r in results]  # fmt: skip
    print(table(["rank", "base only tok/s", f"{NUM_ADAPTERS} adapters + base tok/s",
                 "mixed / base"], rows))  # fmt: skip
    import torch

    out = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "model": args.model or "bundled SmolLM2-135M-Instruct",
        "num_requests": args.num_requests,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "machine": describe(getattr(torch, results[0]["dtype"])),
        "ranks": results,
    }
    save_json(out, args.result_dir, f"lora-{out['date']}.json")
    return 0
