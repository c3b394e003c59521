"""The seed's load script (§4.2) against a running server, and the same requests one by one.

40 completions of "请解释一下" + "机器学习" * k, k drawn from {1, 5, 20, 50}, max_tokens 128,
temperature 0.7, sent all at once with aiohttp exactly as the seed does; then the same 40
requests one at a time. Each request carries a seed (its index) so both passes generate
the same tokens and the two are comparable; `--no-seed` sends the seed's payload as is.
Serve the model under the seed's name first:

    batchpilot serve --served-model-name local-model
    .venv/bin/python benchmarks/seed_load.py --result-dir benchmarks/results
"""

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp

from batchpilot.server.bench.workload import SEED_REPEATS, seed_prompt


def payloads(num: int, rng: random.Random, seeded: bool) -> list[dict]:
    out = []
    for i in range(num):
        body = {
            "model": "local-model",
            "prompt": seed_prompt(rng.choice(SEED_REPEATS)),
            "max_tokens": 128,
            "temperature": 0.7,
        }
        if seeded:
            body["seed"] = i
        out.append(body)
    return out


async def send_one(session, url: str, body: dict) -> tuple[float, int]:
    start = time.time()
    async with session.post(url, json=body) as resp:
        data = await resp.json()
    return time.time() - start, data["usage"]["completion_tokens"]


async def concurrent(url: str, bodies: list[dict]) -> list[tuple[float, int]]:
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(send_one(session, url, b) for b in bodies))


async def one_by_one(url: str, bodies: list[dict]) -> list[tuple[float, int]]:
    async with aiohttp.ClientSession() as session:
        return [await send_one(session, url, b) for b in bodies]


def summarize(results: list[tuple[float, int]], wall: float) -> dict:
    latencies = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {
        "wall_s": wall,
        "mean_latency_s": sum(latencies) / len(latencies),
        "max_latency_s": max(latencies),
        "completion_tokens": tokens,
        "output_tok_per_s": tokens / wall,
    }


async def timed(run, url, bodies) -> dict:
    start = time.time()
    results = await run(url, bodies)
    return summarize(results, time.time() - start)


async def main(args) -> dict:
    url = args.url.rstrip("/") + "/v1/completions"
    bodies = payloads(args.num_requests, random.Random(args.seed), not args.no_seed)
    await one_by_one(url, bodies[:1])  # warm-up
    together = await timed(concurrent, url, bodies)
    alone = await timed(one_by_one, url, bodies)
    return {
        "num_requests": args.num_requests,
        "seeded": not args.no_seed,
        "concurrent": together,
        "one_by_one": alone,
        "throughput_ratio": together["output_tok_per_s"] / alone["output_tok_per_s"],
        "latency_ratio": together["mean_latency_s"] / alone["mean_latency_s"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0, help="draws the prompt lengths")
    parser.add_argument("--no-seed", action="store_true", help="send no per-request seed")
    parser.add_argument("--result-dir", type=Path)
    args = parser.parse_args()
    report = asyncio.run(main(args))
    print(json.dumps(report, indent=2))
    if args.result_dir:
        args.result_dir.mkdir(parents=True, exist_ok=True)
        name = time.strftime("seed-load-%Y%m%d-%H%M%S.json")
        (args.result_dir / name).write_text(json.dumps(report, indent=2) + "\n")
