"""/admin/config: the engine configuration in force, and live changes to it.

Disabled (404, as if absent) unless an admin token is configured; 401 without the right
`Authorization: Bearer <token>`. The token is checked before the body is even parsed.
EngineConfig.live_change decides what may change and how.
"""

import functools
import json
import logging

from fastapi import APIRouter, Depends, Request

from batchpilot.server.api.auth import bearer_token, token_matches
from batchpilot.server.api.context import ServerContext, get_context
from batchpilot.server.api.errors import APIError
from batchpilot.server.api.generation import require_engine
from batchpilot.server.config import ConfigError

logger = logging.getLogger(__name__)
router = APIRouter()


def require_admin(request: Request, ctx: ServerContext = Depends(get_context)) -> ServerContext:
    if not ctx.admin_token:
        raise APIError(404, "Not Found")
    if not token_matches(bearer_token(request.headers), ctx.admin_token):
        raise APIError(
            401, "Invalid or missing admin token", headers={"WWW-Authenticate": "Bearer"}
        )
    require_engine(ctx)
    return ctx


def _config_in_force(engine) -> dict:
    return engine.config.public()


def _apply_changes(changes: dict, engine) -> dict:
    """On the engine thread (or process), between two steps: the settings before."""
    before = engine.config.public()
    engine.apply_live_change(changes)
    return before


@router.get("/admin/config")
async def get_config(ctx: ServerContext = Depends(require_admin)) -> dict:
    return await ctx.engine.call(_config_in_force)


@router.patch("/admin/config")
async def patch_config(request: Request, ctx: ServerContext = Depends(require_admin)) -> dict:
    try:
        changes = json.loads(await request.body() or b"null")
    except json.JSONDecodeError as e:
        raise APIError(400, f"Malformed JSON in the request body: {e}") from e
    if not isinstance(changes, dict):
        raise APIError(400, "The body must be a JSON object of settings to change")

    try:
        before = await ctx.engine.call(functools.partial(_apply_changes, changes))
    except ConfigError as e:
        raise APIError(400, str(e)) from e
    for name, value in changes.items():
        logger.info("admin: %s %s -> %s", name, before[name], value)
    return await ctx.engine.call(_config_in_force)


@router.get("/admin/lora_adapters")
async def lora_adapters(ctx: ServerContext = Depends(require_admin)) -> dict:
    """The loaded adapters with their directories as root, as vLLM's /v1/models shows them:
    the operator compares them with its spec's sources. The public /v1/models hides paths."""
    data = [{"id": a.name, "object": "model", "root": a.path,
             "parent": a.base_model_name or ctx.served_model_name} for a in ctx.loras.values()]  # fmt: skip
    return {"object": "list", "data": data}
