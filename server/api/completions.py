"""POST /v1/completions."""

from fastapi import APIRouter, Depends, Request

from batchpilot.server.api import responses as r
from batchpilot.server.api.context import ServerContext, get_context
from batchpilot.server.api.errors import APIError
from batchpilot.server.api.generation import check_model, require_engine
from batchpilot.server.api.logprobs import completion_logprobs
from batchpilot.server.api.prompts import completion_prompts
from batchpilot.server.api.protocol import CompletionRequest
from batchpilot.server.api.serving import Endpoint, respond

router = APIRouter()

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _logprobs(reply, token_ids: list[int], positions: list, text_offset: int) -> dict:
    return completion_logprobs(reply.tokenizer, token_ids, positions, text_offset)


COMPLETIONS = Endpoint("cmpl", "text_completion", "text_completion", r.completion_choice,
                       r.completion_choice, _logprobs)  # fmt: skip


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request,
                            ctx: ServerContext = Depends(get_context)):  # fmt: skip
    model, lora_name = check_model(ctx, body.model)
    require_engine(ctx)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo), got 0",
                       "max_tokens")  # fmt: skip
    prompts = await completion_prompts(ctx.engine.tokenizer, ctx.engine.config.max_model_len,
                                       body.prompts())  # fmt: skip
    return await respond(ctx, request, body, COMPLETIONS, model, prompts, max_tokens,
                         echo=body.echo, lora_name=lora_name)  # fmt: skip
