"""Response bodies and SSE chunks in OpenAI's shapes. Pure functions of their inputs: plain
dicts serialized with json, because a streaming server builds one chunk per choice per
step and pydantic's per-object overhead would show up there."""

import json
import time
import uuid

DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict | None = None, stop_reason: int | str | None = None) -> dict:  # fmt: skip
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}  # fmt: skip


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
                stop_reason: int | str | None = None) -> dict:  # fmt: skip
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_delta_choice(index: int, delta: dict, finish_reason: str | None,
                      logprobs: dict | None = None, stop_reason: int | str | None = None) -> dict:  # fmt: skip
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def body(kind: str, request_id: str, model: str, choices: list[dict], usage_: dict,
         created: int | None = None) -> dict:  # fmt: skip
    """A whole response. kind: "text_completion" or "chat.completion"."""
    return {
        "id": request_id,
        "object": kind,
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chunk(kind: str, request_id: str, model: str, created: int, choices: list[dict],
          usage_: dict | None = None, with_usage_field: bool = False) -> dict:  # fmt: skip
    """One streamed chunk. kind: "text_completion" or "chat.completion.chunk". With
    stream_options.include_usage every chunk carries "usage": null and the last one carries
    the totals with no choices, as OpenAI sends them."""
    body = {"id": request_id, "object": kind, "created": created, "model": model,
            "choices": choices}  # fmt: skip
    if with_usage_field or usage_ is not None:
        body["usage"] = usage_
    return body


def model_list(model: str, max_model_len: int, created: int, adapters=()) -> dict:
    """The served model, then each LoRA adapter (lora_modules.LoRAModule), its base model as
    parent. vLLM shows an adapter's directory as root; here root is its name, as the served
    model's is, because anyone may read /v1/models and the server's paths are not theirs."""
    cards = [_model_card(model, model, None, max_model_len, created)]
    for a in adapters:
        parent = a.base_model_name or model
        cards.append(_model_card(a.name, a.name, parent, max_model_len, created))
    return {"object": "list", "data": cards}


def _model_card(id_: str, root: str, parent: str | None, max_model_len: int,
                created: int) -> dict:  # fmt: skip
    return {
        "id": id_,
        "object": "model",
        "created": created,
        "owned_by": "batchpilot",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
    }
