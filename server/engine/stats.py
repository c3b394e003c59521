"""EngineStats: a snapshot of the engine's queues, KV cache and counters after a step. The
metrics endpoint, the stats log line, the admin API and the tests read its attributes."""

import dataclasses
from dataclasses import dataclass

from batchpilot.server.config import EngineConfig
from batchpilot.server.engine.scheduler import Scheduler, SchedulerCounters
from batchpilot.server.kv.manager import cdiv


@dataclass(kw_only=True)
class EngineStats(SchedulerCounters):
    """The scheduler's counters since the engine started, plus the state below."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0-1
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    cpu_cache_usage: float  # fraction of CPU swap blocks in use, 0-1
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str
    block_size: int
    max_concurrency: float  # max_model_len-token sequences the KV cache holds at once
    # time.monotonic() arrival of the oldest request waiting to be scheduled; None: none waits.
    oldest_waiting_arrival: float | None = None
    max_lora: int = 0  # 0 with LoRA off
    running_lora_adapters: list[str] = dataclasses.field(default_factory=list)  # sorted
    waiting_lora_adapters: list[str] = dataclasses.field(default_factory=list)  # and swapped
    # The decode steps' CUDA-graph sizes once captured (names.DECODE_GRAPHS_INFO); () before.
    decode_graph_sizes: tuple[int, ...] = ()


def engine_stats(scheduler: Scheduler, config: EngineConfig,
                 decode_graph_sizes: tuple[int, ...] = ()) -> EngineStats:  # fmt: skip
    pool, swap = scheduler.kv.pool, scheduler.kv.swap
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        num_kv_blocks=pool.num_blocks,
        num_free_kv_blocks=pool.num_free,
        kv_cache_usage=1.0 - pool.num_free / pool.num_blocks,
        num_cpu_blocks=swap.num_blocks,
        num_free_cpu_blocks=swap.num_free,
        cpu_cache_usage=1.0 - swap.num_free / swap.num_blocks if swap.num_blocks else 0.0,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_dtype=config.kv_cache_dtype,
        block_size=config.block_size,
        max_concurrency=pool.num_blocks / cdiv(config.max_model_len, config.block_size),
        oldest_waiting_arrival=(
            scheduler.waiting[0].timings.arrival_time if scheduler.waiting else None
        ),
        max_lora=config.max_loras if config.enable_lora else 0,
        running_lora_adapters=_adapters(scheduler.running),
        waiting_lora_adapters=_adapters([*scheduler.waiting, *scheduler.swapped]),
        decode_graph_sizes=decode_graph_sizes,
        **dataclasses.asdict(scheduler.counters),
    )


def _adapters(seqs) -> list[str]:
    return sorted({seq.lora_name for seq in seqs if seq.lora_name is not None})
