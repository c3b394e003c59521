"""`batchpilot bench serve`: one online run against a running server, one JSON file."""

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

from batchpilot.server.bench.goodput import parse_slo
from batchpilot.server.bench.loadgen import LoadSpec, run_load
from batchpilot.server.bench.machine import cpu_info
from batchpilot.server.bench.results import aggregate
from batchpilot.server.bench.workload import (
    DEFAULT_OUTPUT_LENS,
    SEED_REPEATS,
    make_workload,
    parse_int_list,
)


def add_workload_arguments(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--output-lens", type=parse_int_list, default=DEFAULT_OUTPUT_LENS,
                   help="output lengths drawn per request (EOS ignored), e.g. 16,32,64,128")  # fmt: skip
    g.add_argument("--prompt-repeats", type=parse_int_list, default=SEED_REPEATS,
                   help="k in the seed prompt '请解释一下' + '机器学习' * k")  # fmt: skip
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--result-dir", type=Path, default=Path("bench-results"))


def add_load_arguments(parser: argparse.ArgumentParser, with_concurrency: bool = True) -> None:
    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")  # fmt: skip
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps; 1.0 is Poisson")  # fmt: skip
    if with_concurrency:  # a sweep sets it per run
        g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--num-warmups", type=int, default=1)
    g.add_argument("--slo", "--goodput", dest="slo", default=None,
                   help="goodput SLO, e.g. ttft:500,tpot:50 (milliseconds)")  # fmt: skip
    g.add_argument("--metric-percentiles", type=parse_int_list, default=(50, 90, 99))
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send vLLM's ignore_eos so output lengths are exact")  # fmt: skip
    g.add_argument("--api-key", default=None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="base URL of an OpenAI-compatible server")  # fmt: skip
    parser.add_argument("--model", default=None, help="model id (default: from /v1/models)")
    parser.add_argument("--result-filename", default=None)
    add_workload_arguments(parser, num_prompts=64)
    add_load_arguments(parser)


def load_spec(args: argparse.Namespace, base_url: str, model: str | None) -> LoadSpec:
    return LoadSpec(
        base_url=base_url.rstrip("/"),
        model=model,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        burstiness=args.burstiness,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        num_warmups=args.num_warmups,
    )


def bench_serve(args: argparse.Namespace, spec: LoadSpec, progress: bool) -> dict:
    """Run the load once; the result carries its own settings so a file stands alone."""
    requests = make_workload(args.num_prompts, args.seed, args.output_lens, args.prompt_repeats)
    slo = parse_slo(args.slo)
    load = asyncio.run(run_load(spec, requests, progress))
    percentiles = tuple(float(p) for p in args.metric_percentiles)
    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "url": spec.base_url,
        "model_id": load.model,
        "num_prompts": args.num_prompts,
        "request_rate": spec.request_rate,
        "burstiness": spec.burstiness,
        "max_concurrency": spec.max_concurrency,
        "seed": spec.seed,
        "client_machine": cpu_info(),  # the server's, too, when it runs beside the client
    }
    result.update(aggregate(load.results, load.duration_s, slo, percentiles))
    return result


def write_result(result: dict, result_dir: Path, filename: str | None) -> Path:
    if filename is None:
        model = re.sub(r"[^A-Za-z0-9_.-]+", "_", result["model_id"])[-40:]
        rate = result["request_rate"]
        filename = (
            f"serve-{model}-{rate:g}qps-concurrency{result['max_concurrency']}"
            f"-{result['date']}.json"
        )
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / filename
    # json writes inf as Infinity; vLLM's files do the same for an unlimited request rate.
    path.write_text(json.dumps(result, indent=2))
    return path


def print_summary(result: dict) -> None:
    lines = [
        f"{'completed / failed':<28}{result['completed']} / {result['failed']}",
        f"{'duration (s)':<28}{result['duration']:.2f}",
        f"{'request throughput (req/s)':<28}{result['request_throughput']:.2f}",
        f"{'request goodput (req/s)':<28}{result['request_goodput']:.2f}",
        f"{'output throughput (tok/s)':<28}{result['output_throughput']:.1f}",
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        keys = [k for k in result if k.endswith(f"_{metric}_ms")]
        lines.append(
            f"{metric.upper() + ' (ms)':<28}"
            + "  ".join(f"{k.split('_')[0]} {result[k]:.1f}" for k in keys)
        )
    print("\n".join(lines))


def run(args: argparse.Namespace) -> int:
    result = bench_serve(args, load_spec(args, args.url, args.model), progress=True)
    print_summary(result)
    path = write_result(result, args.result_dir, args.result_filename)
    print(f"results: {path}")
    return 0 if result["failed"] == 0 else 1
