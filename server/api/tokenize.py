"""/tokenize, /detokenize and /version, in vLLM's shapes.

/tokenize takes either {"prompt": ...} (add_special_tokens defaults to true) or
{"messages": [...]} rendered through the chat template (add_generation_prompt defaults
to true, add_special_tokens to false: the template already places them), and answers
{"count", "max_model_len", "tokens", "token_strs"}. /detokenize takes {"tokens": [...]}
and answers {"prompt": ...}.
"""

from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

import batchpilot
from batchpilot.server.api.context import ServerContext, get_context
from batchpilot.server.api.errors import APIError
from batchpilot.server.api.generation import check_model, require_engine
from batchpilot.server.api.prompts import check_chars, check_messages, off_loop
from batchpilot.server.api.protocol import ChatMessage, TokenId

router = APIRouter()


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(fail_fast=True)]


@router.post("/tokenize")
async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest,
                   ctx: ServerContext = Depends(get_context)):  # fmt: skip
    check_model(ctx, body.model)
    require_engine(ctx)
    tokenizer, max_model_len = ctx.engine.tokenizer, ctx.engine.config.max_model_len
    if isinstance(body, TokenizeChatRequest):
        check_messages(tokenizer, max_model_len, body.messages)
        ids = await off_loop(chat_token_ids, tokenizer, body)
    else:
        check_chars(tokenizer, max_model_len, len(body.prompt), "prompt")
        ids = await off_loop(_token_ids, tokenizer, body)
    return {
        "count": len(ids),
        "max_model_len": ctx.engine.config.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }


def _token_ids(tokenizer, body: TokenizeCompletionRequest) -> list[int]:
    return tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]


def chat_token_ids(tokenizer, body: TokenizeChatRequest) -> list[int]:
    if body.add_generation_prompt and body.continue_final_message:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "This model has no chat template; send a prompt instead")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=False,
        )
    except Exception as e:  # a template can reject a conversation (e.g. role order)
        raise APIError(400, f"The chat template rejected the messages: {e}", "messages") from e
    return tokenizer(text, add_special_tokens=body.add_special_tokens)["input_ids"]


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: ServerContext = Depends(get_context)):
    check_model(ctx, body.model)
    require_engine(ctx)
    tokenizer = ctx.engine.tokenizer
    vocab = len(tokenizer)
    if any(t >= vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
    return {"prompt": await off_loop(tokenizer.decode, body.tokens)}


@router.get("/version")
async def version():
    return {"version": batchpilot.__version__}
