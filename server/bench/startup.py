"""`batchpilot bench startup`: how long `batchpilot serve` takes from its process's start
to /ready and to the first token of one request, with the server's own start-up
timeline (server/api/timeline.py) per stage, median over N starts per dtype.

Every start after the first reads the weights from the page cache (warm): a cold page
cache cannot be had without root and dropping every other process's cache too. The first
token is what a request held at zero waits for once the process starts (what the
activator forwards as soon as the replica is Ready, docs/activator.md)."""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from batchpilot.server.api.timeline import parse_startup_line
from batchpilot.server.bench.machine import cpu_info
from batchpilot.server.bench.server_process import LAUNCH, free_port

# /ready is asked this often: a coarser poll would add its own wait to every figure.
POLL_S = 0.01
PROMPT = "The capital of France is"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model to serve (default: the bundled one)")
    parser.add_argument("--dtype", action="append", default=None,
                        help="weight dtype per series, repeatable (default: float32 and auto)")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3, help="starts per dtype")
    parser.add_argument("--label", default="", help="recorded with the result (before, after)")
    day = datetime.date.today().strftime("%Y%m%d")
    parser.add_argument("--out", type=Path, default=Path(f"benchmarks/results/startup-{day}.json"),
                        help="JSON result; an existing file gains this run under --label")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per start")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a copy of an earlier batchpilot (the folder holding its batchpilot/ "
                        "package, server/ inside it) started alternately with this one, so "
                        "both series see the same load on a shared machine")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    trees = {"": None} if args.baseline is None else {"baseline": str(args.baseline), "": None}
    series = {}
    for dtype in args.dtype or ["float32", "auto"]:
        serve_args = ["--dtype", dtype] + (["--model", args.model] if args.model else [])
        starts: dict[str, list] = {name: [] for name in trees}
        for _ in range(args.runs):
            for name, path in trees.items():
                starts[name].append(one_start(serve_args, args.timeout, path))
        for name, runs in starts.items():
            series[f"{dtype} {name}".strip()] = {"starts": runs, "median": medians(runs)}
    record = {"label": args.label, "date": datetime.datetime.now(datetime.UTC).isoformat(
        timespec="seconds"), "page_cache": "warm", "machine": cpu_info(), "series": series}  # fmt: skip
    write_record(args.out, record)
    print(table(record))
    return 0


def one_start(serve_args: list[str], timeout_s: float, pythonpath: str | None = None) -> dict:
    """Start a server (from the tree at pythonpath if given), wait for /ready, stream one
    single-token completion, stop it. -> seconds from the spawn to ready and to the first
    token, the server's stages, and the load average the start saw."""
    port = free_port()
    argv = [sys.executable, "-c", LAUNCH, "serve", "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:  # a pipe nobody reads would stall the server
        started = time.monotonic()
        # In the baseline's folder: `python -c` puts the working directory first on the path.
        env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath,
            # Its kernels cached apart: under the same names with other flags, torch would
            # rebuild them at every other start (a minute each, in "allocating the KV cache").
            "TORCH_EXTENSIONS_DIR": os.path.join(pythonpath, ".torch_extensions")}  # fmt: skip
        proc = subprocess.Popen([*argv, *serve_args], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=pythonpath)  # fmt: skip
        try:
            ready = wait_ready(proc, url, started + timeout_s) - started
            first = first_token(url) - started
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        log.seek(0)
        text = log.read()
    stages = parse_startup_line(text)
    if not stages:
        raise RuntimeError(f"no start-up line in the server's log:\n{text[-3000:]}")
    return {"ready_s": round(ready, 3), "first_token_s": round(first, 3), "stages": stages,
            "load_average_1m": os.getloadavg()[0]}  # fmt: skip


def wait_ready(proc: subprocess.Popen, url: str, deadline: float) -> float:
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                if client.get(f"{url}/ready").status_code == 200:
                    return time.monotonic()
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(POLL_S)
    raise RuntimeError("the server was not ready in time")


def first_token(url: str) -> float:
    """When the first streamed token of one greedy completion arrived."""
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic()
    raise RuntimeError("the completion streamed no token")


def medians(starts: list[dict]) -> dict:
    keys = dict.fromkeys(k for s in starts for k in s["stages"])
    out = {k: round(statistics.median(s["stages"].get(k, 0.0) for s in starts), 3) for k in keys}
    for key in ("ready_s", "first_token_s"):
        out[key] = round(statistics.median(s[key] for s in starts), 3)
    return out


def write_record(path: Path, record: dict) -> None:
    """One file per day; its runs keyed by label, so a before and an after sit together."""
    runs = json.loads(path.read_text()) if path.is_file() else {}
    runs[record["label"] or "run"] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(runs, indent=1) + "\n")


def table(record: dict) -> str:
    """Markdown: one row per stage (and ready, first token), one column per dtype."""
    series = record["series"]
    keys = list(dict.fromkeys(k for s in series.values() for k in s["median"]))
    head = f"| median of {len(next(iter(series.values()))['starts'])} starts, s | "
    lines = [head + " | ".join(series) + " |", "|---" * (len(series) + 1) + "|"]
    for key in keys:
        cells = " | ".join(f"{s['median'].get(key, 0.0):.2f}" for s in series.values())
        lines.append(f"| {key} | {cells} |")
    return "\n".join(lines)
