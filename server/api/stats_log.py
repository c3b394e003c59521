"""The periodic engine stats line, worded like vLLM's so that log searches carry over."""

import asyncio
import logging
import time
from collections.abc import Callable

logger = logging.getLogger("batchpilot.stats")


def stats_line(previous: dict, current: dict, seconds: float) -> str:
    """One line from two engine.stats() snapshots taken `seconds` apart."""

    def rate(key: str) -> float:
        return (current.get(key, 0) - previous.get(key, 0)) / max(seconds, 1e-9)

    return (
        f"Avg prompt throughput: {rate('prompt_tokens_total'):.1f} tokens/s, "
        f"Avg generation throughput: {rate('generation_tokens_total'):.1f} tokens/s, "
        f"Running: {current.get('num_running', 0)} reqs, "
        f"Swapped: {current.get('num_swapped', 0)} reqs, "
        f"Pending: {current.get('num_waiting', 0)} reqs, "
        f"KV cache usage: {100 * current.get('kv_cache_usage', 0.0):.1f}%, "
        f"CPU KV cache usage: {100 * current.get('cpu_cache_usage', 0.0):.1f}%, "
        f"Preemptions: {current.get('num_preemptions', 0) - previous.get('num_preemptions', 0)}"
    )


def is_idle(previous: dict, current: dict) -> bool:
    """Nothing ran and nothing waits: no line, so an idle server does not fill its log."""
    busy_keys = ("num_running", "num_waiting", "num_swapped")
    steps = current.get("num_steps", 0) - previous.get("num_steps", 0)
    return steps == 0 and not any(current.get(k) for k in busy_keys)


async def log_stats_forever(stats: Callable[[], dict], interval: float) -> None:
    previous, then = dict(stats()), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        current, now = dict(stats()), time.monotonic()
        if not is_idle(previous, current):
            logger.info(stats_line(previous, current, now - then))
        previous, then = current, now
