"""`batchpilot bench offline`: one fixed workload through batchpilot (continuous and static)
and three transformers peers, one after another in one process, as ratios of tok/s."""

import argparse
import json
import os
import time
from pathlib import Path

from batchpilot.server.bench.report import table
from batchpilot.server.bench.systems import SystemRun, TokenRequest
from batchpilot.server.bench.workload import (
    DEFAULT_OUTPUT_LENS,
    SEED_REPEATS,
    make_workload,
    parse_int_list,
)

SYSTEMS = ("continuous", "static", "hf-sequential", "hf-static", "hf-generate-batch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: bundled)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="auto: bfloat16 where the CPU has AVX512-BF16 or AMX, else float32")  # fmt: skip
    parser.add_argument("--linear-backend", default="auto", choices=("auto", "torch", "onednn"),
                        help="batchpilot's linear_backend (the peers run torch's linear)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=32,
                        help="batchpilot --max-num-seqs and every peer's batch size")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-lens", type=parse_int_list, default=DEFAULT_OUTPUT_LENS)
    parser.add_argument("--prompt-repeats", type=parse_int_list, default=SEED_REPEATS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequential-num-prompts", type=int, default=8,
                        help="sequential generate() runs this prefix of the workload only; "
                        "its tok/s is still comparable")  # fmt: skip
    parser.add_argument("--systems", type=lambda s: tuple(s.split(",")), default=SYSTEMS,
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")  # fmt: skip
    parser.add_argument("--efficiency-steps", type=int, default=16,
                        help="decode steps timed for engine efficiency (0: skip)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over all systems; each system reports its fastest round")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--result-dir", type=Path, default=Path("bench-results"))


def run(args: argparse.Namespace) -> int:
    import torch

    from batchpilot.server.bench import engine_runs, hf_baselines, machine
    from batchpilot.server.model.loader import load_hf_model
    from batchpilot.server.platform.device import resolve_device, resolve_dtype

    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    args.dtype = str(resolve_dtype(args.dtype, resolve_device("cpu"))).removeprefix("torch.")
    hf_model, tokenizer = load_hf_model(args.model, getattr(torch, args.dtype))
    print("measuring the matmul peak ...", flush=True)
    host = machine.describe(getattr(torch, args.dtype))
    host["params"] = sum(p.numel() for p in hf_model.parameters())  # tied weights once
    workload = make_workload(args.num_prompts, args.seed, args.output_lens, args.prompt_repeats)
    requests = [TokenRequest(tokenizer(w.prompt)["input_ids"], w.output_len) for w in workload]
    # A short pass over one batch of the real prompts brings every system's first-call costs
    # (allocator growth, kernel selection for these shapes) out of the timed run.
    warmup = [TokenRequest(r.prompt_token_ids, 4) for r in requests[: args.concurrency]]
    engine_kwargs = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.concurrency,
                         max_model_len=args.max_model_len, seed=args.seed,
                         linear_backend=args.linear_backend)  # fmt: skip
    sequential = requests[: args.sequential_num_prompts]
    plan = {
        "continuous": lambda: engine_runs.batchpilot_generate(
            requests, "continuous", engine_kwargs, warmup
        ),
        "static": lambda: engine_runs.batchpilot_generate(
            requests, "static", engine_kwargs, warmup
        ),
        "hf-sequential": lambda: hf_baselines.hf_sequential(
            hf_model, tokenizer, sequential, warmup[:1]
        ),
        "hf-static": lambda: hf_baselines.hf_static(
            hf_model, tokenizer, requests, args.concurrency, warmup
        ),
        "hf-generate-batch": lambda: hf_baselines.hf_generate_batch(
            hf_model, requests, args.concurrency, warmup
        ),
    }
    # First: generate_batch switches the transformers model's attention backend.
    eff = engine_efficiency(args, engine_kwargs, hf_model, requests)
    runs = best_of_rounds(plan, [n for n in SYSTEMS if n in args.systems], args.repeats)
    result = summarize(args, runs, eff, requests, host)
    print(render(result))
    path = write(result, args.result_dir)
    print(f"results: {path}")
    return 0


def engine_efficiency(args, engine_kwargs: dict, hf_model, requests) -> dict | None:
    if args.efficiency_steps <= 0:
        return None
    from batchpilot.server.bench.efficiency import measure_efficiency
    from batchpilot.server.engine.llm_engine import LLMEngine

    print("measuring engine efficiency ...", flush=True)
    engine = LLMEngine(**engine_kwargs)
    longest = max(requests, key=lambda r: len(r.prompt_token_ids))
    return measure_efficiency(engine, hf_model, longest, args.concurrency, args.efficiency_steps)


def best_of_rounds(plan: dict, systems: list[str], repeats: int) -> list[SystemRun]:
    """Other work on a shared machine can only slow a run down, so the fastest of a
    system's rounds is the least disturbed measurement of it; every round is kept."""
    rounds: dict[str, list[SystemRun]] = {name: [] for name in systems}
    for round_index in range(repeats):
        for name, runs_of_system in rounds.items():
            print(f"round {round_index + 1}/{repeats}: {name} ...", flush=True)
            runs_of_system.append(plan[name]())
    best = []
    for runs_of_system in rounds.values():
        fastest = max(runs_of_system, key=lambda run: run.useful_tok_s)
        fastest.round_useful_tok_s = [r.useful_tok_s for r in runs_of_system]
        best.append(fastest)
    return best


def summarize(args, runs: list[SystemRun], eff: dict | None, requests, host: dict) -> dict:
    from batchpilot.server.bench.machine import roofline_seconds

    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    roofline = roofline_seconds(prompt_tokens, output_tokens, host["params"],
                                host["matmul_peak_gflops"])  # fmt: skip
    reference = next((r for r in runs if r.name == "batchpilot continuous"), None)
    rows = []
    for r in runs:
        row = r.as_dict()
        row["batchpilot_speedup"] = reference.useful_tok_s / r.useful_tok_s if reference else None
        # As a rate, so a system that ran a prefix of the workload compares too.
        row["roofline_fraction"] = r.useful_tok_s / (output_tokens / roofline)
        rows.append(row)
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "model": args.model or "bundled SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "linear_backend": args.linear_backend,
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "output_lens": list(args.output_lens),
        "prompt_repeats": list(args.prompt_repeats),
        "seed": args.seed,
        "repeats": args.repeats,
        "cpus": len(os.sched_getaffinity(0)),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "machine": host,
        "roofline_seconds": roofline,
        "systems": rows,
        "engine_efficiency": eff,
    }


def render(result: dict) -> str:
    headers = ["system", "requests", "output tok/s", "useful tok/s", "batchpilot ÷ system",
               "of roofline"]  # fmt: skip
    rows = []
    for s in result["systems"]:
        ratio = s["batchpilot_speedup"]
        rows.append([
            s["name"] + (f" ({s['note']})" if s["note"] else ""),
            str(s["num_requests"]),
            f"{s['output_tok_s']:.1f}",
            f"{s['useful_tok_s']:.1f}",
            f"{ratio:.2f}x" if ratio is not None else "-",
            f"{s['roofline_fraction']:.0%}",
        ])  # fmt: skip
    host = result["machine"]
    text = table(headers, rows) + (
        f"\n\n{host['cpu_model']} ({' '.join(host['cpu_flags'])}), {host['torch_threads']} "
        f"threads, load {host['load_average_1m']:.1f}: {host['dtype']} matmul peak "
        f"{host['matmul_peak_gflops']:.1f} GFLOP/s; roofline {result['roofline_seconds']:.1f} s "
        f"for {result['total_prompt_tokens']} prompt + {result['total_output_tokens']} output "
        f"tokens at {host['params'] / 1e6:.0f}M parameters"
    )
    eff = result["engine_efficiency"]
    if eff:
        text += (
            f"\n\nengine efficiency at batch {eff['batch_size']}, context {eff['context_len']}: "
            f"batchpilot decode {eff['engine_decode_tok_s']:.1f} tok/s vs raw forward "
            f"{eff['raw_forward_tok_s']:.1f} tok/s = {eff['efficiency']:.2f}"
        )
    return text


def write(result: dict, result_dir: Path) -> Path:
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / f"offline-c{result['concurrency']}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2))
    return path
