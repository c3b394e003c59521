"""`batchpilot bench interference`: the seed's §5.2. Short requests decode steadily; one long
prompt (>= 1500 tokens) arrives; we record when each decoder receives each token and report
the decoders' inter-token latency with chunked prefill off and on.

It runs offline through LLMEngine.step(), one step per loop: the token times are then the
engine's own, with no HTTP or client scheduling noise in them, so the difference between
the settings is the prefill's alone."""

import argparse
import itertools
import os
import time
from pathlib import Path

from batchpilot.server.bench.report import save_json, table
from batchpilot.server.bench.stats import percentile
from batchpilot.server.bench.workload import parse_int_list, seed_prompt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: bundled)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--num-decoders", type=int, default=8)
    parser.add_argument("--long-prompt-len", type=int, default=1600)
    parser.add_argument("--steady-steps", type=int, default=16,
                        help="decode steps before and after the long prompt's prefill")  # fmt: skip
    parser.add_argument("--chunk-sizes", type=parse_int_list, default=(64, 256),
                        help="--max-num-batched-tokens values to run with chunked prefill on")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", type=Path, default=Path("bench-results"))


def long_prompt_ids(tokenizer, length: int) -> list[int]:
    ids: list[int] = []
    repeats = 50
    while len(ids) < length:
        ids = tokenizer(seed_prompt(repeats))["input_ids"]
        repeats *= 2
    return ids[:length]


def run_scenario(engine, short_ids: list[int], long_ids: list[int], num_decoders: int,
                 steady_steps: int, tag: str) -> dict:  # fmt: skip
    """Decoders first, the long prompt once all decode, then steady_steps more steps after
    its first token. -> the decoders' token gaps and the long prompt's wait."""
    from batchpilot.server import SamplingParams

    budget = 3 * steady_steps + len(long_ids)  # enough tokens that no decoder finishes early
    params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {f"{tag}-decoder-{i}": [] for i in range(num_decoders)}
    long_id = f"{tag}-long"
    for i, request_id in enumerate(times):
        # A distinct first token per decoder keeps prefix caching out of the picture.
        first = (short_ids[0] + i) % engine.vocab_size
        engine.add_request(request_id, [first, *short_ids[1:]], params)
    steps_done = 0
    long_sent = long_first = measure_from = None
    after = 0
    while after < steady_steps:
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id in times:
                times[out.request_id].append(now)
            elif out.request_id == long_id and long_first is None:
                long_first = now
        decoding = all(times.values())
        if decoding and measure_from is None:
            measure_from = time.perf_counter()
        steps_done += decoding
        if long_sent is None and steps_done >= steady_steps:
            long_params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
            engine.add_request(long_id, long_ids, long_params)
            long_sent = time.perf_counter()
        if long_first is not None:
            after += 1
    for request_id in [*times, long_id]:
        engine.abort_request(request_id)
    engine.step()  # hands back the aborted requests' final outputs, so none leak into the next run
    # Only gaps that start once every decoder decodes: the decoders' own prefill is not what
    # this scenario measures.
    gaps = [b - a for ts in times.values() for a, b in itertools.pairwise(ts) if a >= measure_from]
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    return {
        "num_itl_samples": len(gaps),
        "median_itl_ms": p50 * 1000,
        "p99_itl_ms": p99 * 1000,
        "max_itl_ms": max(gaps) * 1000,
        "p99_over_median": p99 / p50,
        "long_prompt_ttft_ms": (long_first - long_sent) * 1000,
    }


def run(args: argparse.Namespace) -> int:
    from batchpilot.server.engine.llm_engine import LLMEngine

    settings = [("off", None)] + [(f"on, {n}-token budget", n) for n in args.chunk_sizes]
    rows, results = [], []
    for label, chunk in settings:
        engine = LLMEngine(
            model=args.model, dtype=args.dtype, max_num_seqs=args.num_decoders + 1,
            max_model_len=args.max_model_len, enable_chunked_prefill=chunk is not None,
            max_num_batched_tokens=chunk, enable_prefix_caching=False, seed=args.seed,
        )  # fmt: skip
        short_ids = engine.tokenizer(seed_prompt(1))["input_ids"]
        long_ids = long_prompt_ids(engine.tokenizer, args.long_prompt_len)
        # One untimed pass so first-call costs do not land in either setting's numbers.
        run_scenario(engine, short_ids, long_ids[:64], args.num_decoders, 2, "warmup")
        print(f"chunked prefill {label} ...", flush=True)
        r = run_scenario(engine, short_ids, long_ids, args.num_decoders, args.steady_steps, "run")
        r.update(chunked_prefill=chunk is not None, max_num_batched_tokens=chunk, label=label)
        results.append(r)
        rows.append([label, f"{r['median_itl_ms']:.1f}", f"{r['p99_itl_ms']:.1f}",
                     f"{r['max_itl_ms']:.1f}", f"{r['p99_over_median']:.2f}",
                     f"{r['long_prompt_ttft_ms']:.0f}"])  # fmt: skip
        del engine
    headers = ["chunked prefill", "ITL P50 ms", "ITL P99 ms", "ITL max ms", "P99 / P50",
               "long prompt TTFT ms"]  # fmt: skip
    print(table(headers, rows))
    out = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "model": args.model or "bundled SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "num_decoders": args.num_decoders,
        "long_prompt_len": args.long_prompt_len,
        "steady_steps": args.steady_steps,
        "cpus": len(os.sched_getaffinity(0)),
        "settings": results,
    }
    save_json(out, args.result_dir, f"interference-{out['date']}.json")
    return 0
