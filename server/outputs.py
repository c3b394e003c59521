"""What the engine returns per step, shaped like vLLM's RequestOutput."""

from dataclasses import dataclass

from batchpilot.server.sequence import Timings


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Timings
    num_cached_tokens: int = 0
