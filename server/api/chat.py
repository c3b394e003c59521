"""POST /v1/chat/completions: the model's chat template turns messages into a prompt."""

from fastapi import APIRouter, Depends, Request

from batchpilot.server.api import responses as r
from batchpilot.server.api.context import ServerContext, get_context
from batchpilot.server.api.errors import APIError
from batchpilot.server.api.generation import check_model, require_engine
from batchpilot.server.api.logprobs import chat_logprobs
from batchpilot.server.api.prompts import check_messages, off_loop
from batchpilot.server.api.protocol import ChatCompletionRequest
from batchpilot.server.api.serving import Endpoint, respond

router = APIRouter()


def _delta_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                  stop_reason: int | str | None) -> dict:  # fmt: skip
    delta = {"content": text} if text else {}
    return r.chat_delta_choice(index, delta, finish_reason, logprobs, stop_reason)


def _logprobs(reply, token_ids: list[int], positions: list, text_offset: int) -> dict:
    return chat_logprobs(reply.tokenizer, token_ids, positions, reply.body.top_logprobs or 0)


def _opening(index: int) -> dict:
    return r.chat_delta_choice(index, {"role": "assistant", "content": ""}, None)


CHAT = Endpoint("chatcmpl", "chat.completion", "chat.completion.chunk", r.chat_choice,
                _delta_choice, _logprobs, _opening)  # fmt: skip


def render_prompt(tokenizer, body: ChatCompletionRequest) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "This model has no chat template; use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(
            body.template_messages(),
            add_generation_prompt=body.add_generation_prompt,
            tokenize=True,
        )
    except Exception as e:  # a template can reject a conversation (e.g. role order)
        raise APIError(400, f"The chat template rejected the messages: {e}", "messages") from e
    # Newer transformers return a BatchEncoding here.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 ctx: ServerContext = Depends(get_context)):  # fmt: skip
    model, lora_name = check_model(ctx, body.model)
    require_engine(ctx)
    tokenizer, max_model_len = ctx.engine.tokenizer, ctx.engine.config.max_model_len
    check_messages(tokenizer, max_model_len, body.messages)
    prompt = await off_loop(render_prompt, tokenizer, body)
    # Without a limit a chat answer may use the rest of the context, as in vLLM.
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, max_model_len - len(prompt))
    return await respond(ctx, request, body, CHAT, model, [prompt], max_tokens, lora_name=lora_name)
