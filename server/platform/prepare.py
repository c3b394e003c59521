"""The engine process set up for its device, once per engine, before the model loads."""

from typing import NamedTuple

import torch

from batchpilot.server.config import EngineConfig
from batchpilot.server.platform.cpu_budget import cpu_threads
from batchpilot.server.platform.cpu_malloc import keep_freed_memory
from batchpilot.server.platform.device import resolve_device, resolve_dtype


class Placement(NamedTuple):
    device: torch.device
    dtype: torch.dtype


def prepare_process(config: EngineConfig) -> Placement:
    """Where and in which dtype the engine runs. On CPU this also sets torch's threads from
    the CPU budget and tunes malloc: both act on the whole process."""
    device = resolve_device(config.device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(config.cpu_threads))
        keep_freed_memory()
    return Placement(device, resolve_dtype(config.dtype, device))
