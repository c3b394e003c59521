"""POST /v1/completions."""

from fastapi import APIRouter, Depends, Request

from batchpilot.server.api import responses as r
from batchpilot.server.api.context import ServerContext, get_context
from batchpilot.server.api.generation import check_model, require_engine
from batchpilot.server.api.protocol import CompletionRequest
from batchpilot.server.api.serving import Endpoint, respond

router = APIRouter()

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
COMPLETIONS = Endpoint("cmpl", "text_completion", "text_completion", r.completion_choice,
                       r.completion_choice)  # fmt: skip


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request,
                            ctx: ServerContext = Depends(get_context)):  # fmt: skip
    model = check_model(ctx, body.model)
    require_engine(ctx)
    max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
    return await respond(ctx, request, body, COMPLETIONS, model, body.prompts(), max_tokens)
