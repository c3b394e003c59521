"""/health, /ready, /metrics and /v1/models."""

from fastapi import APIRouter, Depends, Response

from batchpilot.server.api import lora_resolver
from batchpilot.server.api import responses as r
from batchpilot.server.api.context import ServerContext, get_context
from batchpilot.server.api.errors import APIError
from batchpilot.server.api.generation import require_engine

router = APIRouter()


@router.get("/health")
async def health(ctx: ServerContext = Depends(get_context)) -> Response:
    """Alive: the process answers and its engine has not died (a liveness probe restarting
    a dead engine is the right outcome). A failed step does not kill it: only
    MAX_CONSECUTIVE_STEP_FAILURES in a row do."""
    if ctx.engine.failure is not None:
        raise APIError(503, f"The engine failed: {ctx.engine.failure!r}")
    return Response(status_code=200)


@router.get("/ready")
async def ready(ctx: ServerContext = Depends(get_context)) -> Response:
    """Loaded and not draining: whether to route new requests here."""
    require_engine(ctx)
    if ctx.lifecycle.draining:
        raise APIError(503, "The server is shutting down")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(ctx: ServerContext = Depends(get_context)) -> Response:
    body, content_type = ctx.metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def models(ctx: ServerContext = Depends(get_context)) -> dict:
    require_engine(ctx)
    # Names only: an adapter's root is its name, never its directory (responses.py).
    return r.model_list(ctx.served_model_name, ctx.engine.config.max_model_len, ctx.created,
                        lora_resolver.served_adapters(ctx))  # fmt: skip
