"""What the engine returns per step, shaped like vLLM's RequestOutput."""

from dataclasses import dataclass

from batchpilot.server.engine.sequence import Timings
from batchpilot.server.sampling.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string, as vLLM's
    logprobs: SampleLogprobs | None = None  # one per token of token_ids, when asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Timings
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # one per prompt token, the first None
    error: str | None = None  # set when the engine failed this request (finished, "abort")
