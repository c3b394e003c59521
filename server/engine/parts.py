"""The parts an LLMEngine is built from, made from its config: the process set up for its
device, the model and its runner, the KV cache's bookkeeping, the scheduler, the output
processor and the LoRA adapters."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchpilot.server.config import EngineConfig
from batchpilot.server.engine.scheduler import Scheduler
from batchpilot.server.kv.block_pool import BlockPool, SwapSpace
from batchpilot.server.kv.manager import KVCacheManager
from batchpilot.server.lora.manager import LoRAManager
from batchpilot.server.model.loader import LOAD_STAGES, load_model
from batchpilot.server.model.runner import ModelRunner
from batchpilot.server.output.processor import OutputProcessor
from batchpilot.server.platform.prepare import prepare_process


@dataclass
class EngineParts:
    device: torch.device
    tokenizer: Any
    vocab_size: int
    eos_token_ids: set[int]
    runner: ModelRunner
    kv_manager: KVCacheManager
    scheduler: Scheduler
    output_processor: OutputProcessor
    loras: LoRAManager


def build_parts(config: EngineConfig, stage: Callable[[str], None]) -> EngineParts:
    """stage(name) is called as each of LOAD_STAGES begins."""
    device, dtype = prepare_process(config)
    loaded = load_model(config, dtype, device, stage)
    stage(LOAD_STAGES[3])
    runner = ModelRunner(config, loaded.decoder, device)
    if runner.kv_cache.is_fp8:
        runner.calibrate_fp8(loaded.tokenizer)
    kv = runner.kv_cache
    pool = BlockPool(kv.num_blocks, config.enable_prefix_caching)
    kv_manager = KVCacheManager(pool, SwapSpace(kv.num_cpu_blocks), config.block_size)
    in_slot = runner.lora_slots.holds if runner.lora_slots else None
    return EngineParts(
        device,
        loaded.tokenizer,
        loaded.vocab_size,
        loaded.eos_token_ids,
        runner,
        kv_manager,
        Scheduler(config, kv_manager, loaded.eos_token_ids, in_slot),
        OutputProcessor(loaded.tokenizer),
        LoRAManager.for_model(config, loaded.decoder, runner.lora_slots),
    )
