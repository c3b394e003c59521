"""What the routes share: one ServerContext per app, reached through app.state."""

import time
from dataclasses import dataclass, field

from fastapi import Request

from batchpilot.server.api.lifecycle import Lifecycle
from batchpilot.server.api.lora_modules import LoRAModule
from batchpilot.server.api.metrics import ServerMetrics
from batchpilot.server.engine.client import EngineClient


@dataclass
class ServerContext:
    engine: EngineClient
    lifecycle: Lifecycle
    metrics: ServerMetrics
    served_model_name: str
    admin_token: str | None
    max_queue_len: int
    stream_stall_timeout: float  # seconds one SSE write may wait for a slow reader
    created: int = field(default_factory=lambda: int(time.time()))
    # The LoRA adapters the engine serves, by name, in load order (server/api/lora.py).
    loras: dict[str, LoRAModule] = field(default_factory=dict)


def get_context(request: Request) -> ServerContext:
    return request.app.state.context
