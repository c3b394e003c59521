"""`batchpilot bench sweep`: start a server per configuration, run the online benchmark over
a list of concurrencies (or --max-num-seqs values), continuous against static, and plot."""

import argparse
import copy
import json
import shlex
import time

from tqdm import tqdm

from batchpilot.server.bench import online
from batchpilot.server.bench.plots import plot_sweep
from batchpilot.server.bench.server_process import running_server
from batchpilot.server.bench.workload import parse_int_list

SUMMARY_DROPS = ("input_lens", "output_lens", "ttfts", "itls", "errors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="passed to batchpilot serve")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--policies", type=lambda s: tuple(s.split(",")),
                        default=("continuous", "static"), help="--scheduling-policy values")  # fmt: skip
    parser.add_argument("--sweep", choices=("max-concurrency", "max-num-seqs"),
                        default="max-concurrency",
                        help="max-concurrency: one server per policy, clients vary; "
                        "max-num-seqs: one server per value, clients at the same value")  # fmt: skip
    parser.add_argument("--values", type=parse_int_list, default=(1, 4, 8, 16, 32))
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="the server's batch limit while sweeping max-concurrency")  # fmt: skip
    parser.add_argument("--serve-args", default="",
                        help="extra flags for batchpilot serve, e.g. '--kv-cache-memory 512MiB'")  # fmt: skip
    online.add_workload_arguments(parser, num_prompts=64)
    online.add_load_arguments(parser)


def server_plan(args) -> list[tuple[str, int | None, list[int]]]:
    """-> [(policy, server max_num_seqs, client concurrencies to run against it)]."""
    if args.sweep == "max-concurrency":
        return [(policy, args.max_num_seqs, list(args.values)) for policy in args.policies]
    return [(policy, value, [value]) for policy in args.policies for value in args.values]


def run(args: argparse.Namespace) -> int:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.result_dir
    plan = server_plan(args)
    points = []
    bar = tqdm(total=sum(len(c) for _, _, c in plan), desc="sweep", unit="run")
    for policy, max_num_seqs, concurrencies in plan:
        serve_args = ["--scheduling-policy", policy, "--max-num-seqs", str(max_num_seqs),
                      "--dtype", args.dtype, *shlex.split(args.serve_args)]  # fmt: skip
        if args.model:
            serve_args += ["--model", args.model]
        log = out_dir / f"server-{policy}-{max_num_seqs}-{stamp}.log"
        bar.set_postfix_str(f"starting {policy} server (max-num-seqs {max_num_seqs})")
        with running_server(serve_args, log) as url:
            for concurrency in concurrencies:
                bar.set_postfix_str(f"{policy} max-num-seqs {max_num_seqs} c={concurrency}")
                run_args = copy.copy(args)
                run_args.max_concurrency = concurrency
                spec = online.load_spec(run_args, url, None)
                result = online.bench_serve(run_args, spec, progress=False)
                result.update(policy=policy, max_num_seqs=max_num_seqs)
                name = f"serve-{policy}-mns{max_num_seqs}-c{concurrency}-{stamp}.json"
                online.write_result(result, out_dir, name)
                points.append({k: v for k, v in result.items() if k not in SUMMARY_DROPS})
                bar.update(1)
    bar.close()
    x_key = "max_concurrency" if args.sweep == "max-concurrency" else "max_num_seqs"
    png = plot_sweep(points, x_key, out_dir / f"sweep-{args.sweep}-{stamp}.png")
    summary = {"date": stamp, "sweep": args.sweep, "plot": str(png), "points": points}
    path = out_dir / f"sweep-{args.sweep}-{stamp}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(render(points, x_key))
    print(f"plot: {png}\nresults: {path}")
    return 0 if all(p["failed"] == 0 for p in points) else 1


def render(points: list[dict], x_key: str) -> str:
    from batchpilot.server.bench.report import table

    headers = ["policy", x_key.replace("_", "-"), "req/s", "output tok/s", "TTFT P50/P99 ms",
               "ITL P50/P99 ms", "E2E P99 ms", "failed"]  # fmt: skip
    rows = [
        [p["policy"], str(p[x_key]), f"{p['request_throughput']:.2f}",
         f"{p['output_throughput']:.1f}",
         f"{p['median_ttft_ms']:.0f} / {p['p99_ttft_ms']:.0f}",
         f"{p['median_itl_ms']:.1f} / {p['p99_itl_ms']:.1f}",
         f"{p['p99_e2el_ms']:.0f}", str(p["failed"])]
        for p in points
    ]  # fmt: skip
    return table(headers, rows)
