"""What publishing KV events (--kv-events-config) costs an engine step: the same workload
with events on and off, alternated on one engine so a shared machine's drifting load hits
both alike, plus the engine thread's own time in the event code (logging each block,
handing a batch to the publisher's thread), timed call by call.

    .venv/bin/python benchmarks/kv_events_cost.py [--rounds 3] [--requests 32]

Bundled model, dtype auto; every request has a 256-token prompt of which the first 128
are shared by groups of four, and 64 output tokens; the KV cache is sized to 1.5 rounds of
requests, so blocks are stored, hit and evicted. Writes results/kv-events-cost-<date>.json.
"""

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import zmq

from batchpilot.server.bench.machine import cpu_info
from batchpilot.server.engine.core import EngineCore
from batchpilot.server.engine.llm_engine import LLMEngine
from batchpilot.server.kv.events import KVEventLog
from batchpilot.server.sampling.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"


class TimedLog(KVEventLog):
    """KVEventLog that sums the engine thread's time in it (and in the hand-over to the
    publisher, through timed())."""

    seconds = 0.0

    def stored(self, *args) -> None:
        start = time.perf_counter()
        super().stored(*args)
        TimedLog.seconds += time.perf_counter() - start

    def removed(self, digest: bytes) -> None:
        start = time.perf_counter()
        super().removed(digest)
        TimedLog.seconds += time.perf_counter() - start


def timed(fn):
    def call(*args):
        start = time.perf_counter()
        fn(*args)
        TimedLog.seconds += time.perf_counter() - start

    return call


def workload(round_: int, requests: int) -> list[list[int]]:
    prompts = []
    for i in range(requests):
        shared = [(round_ * 97 + i // 4 * 13 + t) % 30000 + 100 for t in range(128)]
        prompts.append(shared + [(round_ * 31 + i * 7 + t) % 30000 + 100 for t in range(128)])
    return prompts


def run_round(core: EngineCore, prompts: list[list[int]], tag: str) -> tuple[float, int]:
    """-> (seconds the steps took, steps)."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    adds = [([(f"{tag}-{i}", p, params)], 0.0, None) for i, p in enumerate(prompts)]
    total, steps = 0.0, 0
    turn = core.turn(adds, [], [])
    while True:
        total, steps = total + turn.step_seconds, steps + turn.stepped
        if not core.has_work():
            return total, steps
        turn = core.turn([], [], [])


def switch(core: EngineCore, publisher, log, on: bool) -> None:
    core.kv_events = publisher if on else None
    core.engine.kv_manager.pool.events = log if on else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    sub = zmq.Context.instance().socket(zmq.SUB)  # a real subscriber on loopback
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"}
    probe = LLMEngine(model=None, max_model_len=512)
    block_bytes, block_size = probe.runner.block_bytes, probe.config.block_size
    del probe
    blocks_per_round = args.requests * -(-(256 + 64) // block_size)
    engine = LLMEngine(model=None, max_model_len=512, max_num_seqs=args.requests,
                       kv_cache_memory_bytes=int(1.5 * blocks_per_round * block_bytes),
                       kv_events_config=config)  # fmt: skip
    core = EngineCore(engine)
    publisher, log = core.kv_events, TimedLog(block_size)
    publisher.publish = timed(publisher.publish)
    rows = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            switch(core, publisher, log, mode == "on")
            TimedLog.seconds = 0.0
            started = time.perf_counter()
            seconds, steps = run_round(
                core, workload(r * 2 + (mode == "on"), args.requests), f"{mode}{r}"
            )
            sub.poll(0)  # let libzmq pass the SUB's subscription on (libzmq#2267)
            rows[mode].append({"step_seconds": seconds, "steps": steps,
                               "event_seconds": TimedLog.seconds if mode == "on" else 0.0,
                               "wall_s": time.perf_counter() - started})  # fmt: skip
            print(mode, rows[mode][-1], flush=True)
    switch(core, publisher, log, True)
    core.close()
    summary = summarize(rows, publisher)
    summary["machine"] = cpu_info()
    summary["kv_blocks"] = engine.kv_manager.pool.num_blocks
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"kv-events-cost-{date.today():%Y%m%d}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "machine"}, indent=2))


def summarize(rows: dict, publisher) -> dict:
    per_step = {m: statistics.median(r["step_seconds"] / r["steps"] for r in rows[m]) for m in rows}
    in_thread = statistics.median(r["event_seconds"] / r["step_seconds"] for r in rows["on"])
    return {
        "step_ms_on": per_step["on"] * 1000,
        "step_ms_off": per_step["off"] * 1000,
        "on_over_off": per_step["on"] / per_step["off"],
        "wall_on_over_off": statistics.median(r["wall_s"] for r in rows["on"])
        / statistics.median(r["wall_s"] for r in rows["off"]),
        "event_code_share_of_step": in_thread,
        "batches_published": publisher.next_seq,
        "batches_dropped": publisher.dropped,
        "rounds": rows,
    }


if __name__ == "__main__":
    main()
