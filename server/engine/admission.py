"""What a request must be for the engine to take it: a prompt in token ids that fits the
model and the KV cache, sampling parameters within the vocabulary, an adapter that is
loaded. A request that fails a check is refused before it reaches the scheduler."""

from batchpilot.server.config import EngineConfig
from batchpilot.server.kv.manager import KVCacheManager, cdiv
from batchpilot.server.lora import LoRAError
from batchpilot.server.lora.adapter import LoRAAdapter
from batchpilot.server.lora.manager import LoRAManager
from batchpilot.server.sampling.sampling_params import SamplingParams


class RequestRejected(ValueError):
    """A request that can never be served; the server answers 400."""


def prompt_parts(tokenizer, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of text, token ids, or vLLM's TokensPrompt."""
    if isinstance(prompt, dict):
        return prompt.get("prompt"), list(prompt["prompt_token_ids"])
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt)["input_ids"]
    return None, list(prompt)


def request_adapter(loras: LoRAManager, name: str | None) -> LoRAAdapter | None:
    try:
        return loras.for_request(name)
    except LoRAError as e:
        raise RequestRejected(str(e)) from e


def check_fits(ids: list[int], params: SamplingParams, config: EngineConfig, vocab_size: int,
               kv_manager: KVCacheManager) -> None:  # fmt: skip
    limit = config.max_model_len
    if not ids:
        raise RequestRejected("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in ids):
        raise RequestRejected(f"prompt token ids must be in [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t in params.logit_bias or ()):
        raise RequestRejected(f"logit_bias token ids must be in [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise RequestRejected(f"stop_token_ids must be in [0, {vocab_size})")
    if params.top_k > vocab_size:
        raise RequestRejected(f"top_k must be at most the vocabulary size "
                              f"{vocab_size} (or -1 for all), got {params.top_k}")  # fmt: skip
    if len(ids) > limit:
        raise RequestRejected(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {len(ids)} input tokens. Please reduce the length of the input messages."
        )
    if len(ids) + params.max_tokens > limit:
        raise RequestRejected(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the messages, "
            f"{params.max_tokens} in the completion). Please reduce the length of the "
            "messages or completion."
        )
    blocks = cdiv(len(ids) + params.max_tokens, config.block_size)
    usable = kv_manager.pool.num_blocks - kv_manager.watermark_blocks
    if blocks > usable:
        raise RequestRejected(
            f"the request needs {blocks} KV blocks but the cache can give one sequence "
            f"at most {usable}; reduce the prompt or max_tokens"
        )
