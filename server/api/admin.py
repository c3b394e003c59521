"""/admin/config: the engine configuration in force, and live changes to it.

Disabled (404, as if absent) unless an admin token is configured; 401 without the right
`Authorization: Bearer <token>`. The token is checked before the body is even parsed.
"""

import json
import logging

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from batchpilot import names
from batchpilot.server.api.auth import bearer_token, token_matches
from batchpilot.server.api.context import ServerContext, get_context
from batchpilot.server.api.errors import APIError
from batchpilot.server.api.generation import require_engine

logger = logging.getLogger(__name__)
router = APIRouter()


class ConfigPatch(BaseModel):
    """The knobs that change live: names.LIVE_KNOBS."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: StrictInt | None = Field(default=None, ge=1)


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


@router.get("/admin/config")
async def get_config(ctx: ServerContext = Depends(require_admin)) -> dict:
    return await ctx.engine.call(_config_in_force)


@router.patch("/admin/config")
async def patch_config(request: Request, ctx: ServerContext = Depends(require_admin)) -> dict:
    try:
        patch = ConfigPatch.model_validate(json.loads(await request.body() or b"null"))
    except json.JSONDecodeError as e:
        raise APIError(400, f"Malformed JSON in the request body: {e}") from e
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            message = f"{param} cannot be changed while the server runs; live: {names.LIVE_KNOBS}"
        else:
            message = f"{param or 'body'}: {first['msg']}"
        raise APIError(400, message, param) from e
    if patch.max_num_seqs is not None:
        new = patch.max_num_seqs

        def apply(engine):
            old = engine.config.max_num_seqs
            engine.set_max_num_seqs(new)
            return old

        old = await ctx.engine.call(apply)
        logger.info("admin: %s %d -> %d", names.MAX_NUM_SEQS.name, old, new)
    return await ctx.engine.call(_config_in_force)
