"""The sweep's yardstick for HTTP and async overhead: the same workload through LLM.generate in
one process, with the engine settings the server gets, so online tok/s divides by it."""

import argparse
import dataclasses
import gc
import time

from batchpilot.server.bench.workload import BenchRequest
from batchpilot.server.config import add_engine_args, config_from_args


def engine_kwargs_from_serve_args(serve_args: list[str]) -> dict:
    """Parse the flags the sweep passes to `batchpilot serve` with serve's own engine parser."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_engine_args(parser)
    args, _ = parser.parse_known_args(serve_args)
    config = config_from_args(args)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def offline_output_tok_s(serve_args: list[str], requests: list[BenchRequest]) -> float:
    from batchpilot.server import LLM, SamplingParams

    llm = LLM(**engine_kwargs_from_serve_args(serve_args))
    try:
        params = [
            SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            for r in requests
        ]
        prompts = [r.prompt for r in requests]
        llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up, as the online run has
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        del llm
        gc.collect()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
