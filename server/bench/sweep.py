"""`batchpilot bench sweep`: start a server per configuration, run the online benchmark over
a list of concurrencies (or --max-num-seqs values), continuous against static, and plot."""

import argparse
import copy
import json
import shlex
import time

from tqdm import tqdm

from batchpilot.server.bench import online
from batchpilot.server.bench.offline_reference import offline_output_tok_s
from batchpilot.server.bench.plots import plot_sweep
from batchpilot.server.bench.server_process import running_server
from batchpilot.server.bench.workload import make_workload, parse_int_list

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
    parser.add_argument("--offline-reference", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="also run the workload offline per policy and report online / "
                        "offline throughput where concurrency equals max-num-seqs")  # fmt: skip
    online.add_workload_arguments(parser, num_prompts=64)
    online.add_load_arguments(parser, with_concurrency=False)


def server_plan(args) -> list[tuple[str, int | None, list[int]]]:
    """-> [(policy, server max_num_seqs, client concurrencies to run against it)]."""
    if args.sweep == "max-concurrency":
        return [(policy, args.max_num_seqs, list(args.values)) for policy in args.policies]
    return [(policy, value, [value]) for policy in args.policies for value in args.values]


def run(args: argparse.Namespace) -> int:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    plan = server_plan(args)
    points = []
    bar = tqdm(total=sum(len(c) for _, _, c in plan), desc="sweep", unit="run")
    for policy, max_num_seqs, concurrencies in plan:
        points += run_one_server(args, policy, max_num_seqs, concurrencies, stamp, bar)
    bar.close()
    x_key = "max_concurrency" if args.sweep == "max-concurrency" else "max_num_seqs"
    png = plot_sweep(points, x_key, args.result_dir / f"sweep-{args.sweep}-{stamp}.png")
    summary = {"date": stamp, "sweep": args.sweep, "plot": str(png), "points": points}
    path = args.result_dir / f"sweep-{args.sweep}-{stamp}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(render(points, x_key))
    for p in points:
        if "online_over_offline" in p:
            print(f"{p['policy']} at concurrency {p['max_concurrency']}: online "
                  f"{p['output_throughput']:.1f} tok/s / offline "
                  f"{p['offline_output_throughput']:.1f} tok/s = {p['online_over_offline']:.2f}")  # fmt: skip
    print(f"plot: {png}\nresults: {path}")
    return 0 if all(p["failed"] == 0 for p in points) else 1


def run_one_server(args, policy: str, max_num_seqs: int, concurrencies: list[int], stamp: str,
                   bar: tqdm) -> list[dict]:  # fmt: skip
    """One server configuration: its offline reference, then each client concurrency."""
    serve_args = ["--scheduling-policy", policy, "--max-num-seqs", str(max_num_seqs),
                  "--dtype", args.dtype, *shlex.split(args.serve_args)]  # fmt: skip
    if args.model:
        serve_args += ["--model", args.model]
    offline_tok_s = None
    if args.offline_reference and max_num_seqs in concurrencies:
        bar.set_postfix_str(f"{policy} offline reference (max-num-seqs {max_num_seqs})")
        requests = make_workload(args.num_prompts, args.seed, args.output_lens,
                                 args.prompt_repeats)  # fmt: skip
        offline_tok_s = offline_output_tok_s(serve_args, requests)
    log = args.result_dir / f"server-{policy}-{max_num_seqs}-{stamp}.log"
    bar.set_postfix_str(f"starting {policy} server (max-num-seqs {max_num_seqs})")
    points = []
    with running_server(serve_args, log) as url:
        for concurrency in concurrencies:
            bar.set_postfix_str(f"{policy} max-num-seqs {max_num_seqs} c={concurrency}")
            run_args = copy.copy(args)
            run_args.max_concurrency = concurrency
            result = online.bench_serve(run_args, online.load_spec(run_args, url, None), False)
            result.update(policy=policy, max_num_seqs=max_num_seqs)
            if offline_tok_s is not None and concurrency == max_num_seqs:
                result["offline_output_throughput"] = offline_tok_s
                result["online_over_offline"] = result["output_throughput"] / offline_tok_s
            name = f"serve-{policy}-mns{max_num_seqs}-c{concurrency}-{stamp}.json"
            online.write_result(result, args.result_dir, name)
            points.append({k: v for k, v in result.items() if k not in SUMMARY_DROPS})
            bar.update(1)
    return points


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
