"""The periodic engine stats line, worded like vLLM's so that log searches carry over."""

import asyncio
import logging
import time
from collections.abc import Callable

from batchpilot.server.engine.stats import EngineStats

logger = logging.getLogger("batchpilot.stats")


def stats_line(previous: EngineStats, current: EngineStats, seconds: float) -> str:
    """One line from two engine.stats() snapshots taken `seconds` apart."""
    seconds = max(seconds, 1e-9)
    prompt_rate = (current.prompt_tokens_total - previous.prompt_tokens_total) / seconds
    generation_rate = (current.generation_tokens_total - previous.generation_tokens_total) / seconds
    return (
        f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
        f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
        f"Running: {current.num_running} reqs, "
        f"Swapped: {current.num_swapped} reqs, "
        f"Pending: {current.num_waiting} reqs, "
        f"KV cache usage: {100 * current.kv_cache_usage:.1f}%, "
        f"CPU KV cache usage: {100 * current.cpu_cache_usage:.1f}%, "
        f"Preemptions: {current.num_preemptions - previous.num_preemptions}"
    )


def is_idle(previous: EngineStats, current: EngineStats) -> bool:
    """Nothing ran and nothing waits: no line, so an idle server does not fill its log."""
    busy = current.num_running or current.num_waiting or current.num_swapped
    return current.num_steps == previous.num_steps and not busy


async def log_stats_forever(stats: Callable[[], EngineStats | None], interval: float) -> None:
    """stats() is the latest snapshot, None while the engine loads."""
    previous, then = stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        current, now = stats(), time.monotonic()
        if previous is not None and not is_idle(previous, current):
            logger.info(stats_line(previous, current, now - then))
        previous, then = current, now
