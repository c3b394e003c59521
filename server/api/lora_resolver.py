"""Adapters loaded on first use from --lora-resolver-dir (vLLM's filesystem resolver;
server/lora/resolver.py finds them): the set the resolver loaded, apart from ctx.loras,
and the lock that orders every adapter load and unload of a server (lora.py's routes take
it too).

The resolver's adapters are kept out of ctx.loras because /admin/lora_adapters lists
ctx.loras to the operator, which unloads whatever a replica lists that its spec.adapters
does not name. Clients see both (/v1/models, `model`). A name the resolver does not find
is the unknown model's 404; one it finds but cannot load is vLLM's 400 "LoRA adapter
'<name>' was found but could not be loaded." (the reason goes to the log: it may name the
server's paths; the registration bound reached, which names none, is told)."""

import asyncio
import functools
import logging
from dataclasses import dataclass, field

from batchpilot.server.api.context import ServerContext
from batchpilot.server.api.errors import APIError
from batchpilot.server.api.lora_modules import LoRAModule
from batchpilot.server.engine.client import EngineFailed, EngineNotReady
from batchpilot.server.lora import LoRAError, LoRAFull
from batchpilot.server.lora.resolver import find_adapter

logger = logging.getLogger(__name__)


# An engine call, module-level so that it pickles to an engine process.
def add_lora(name: str, path: str, engine) -> None:
    engine.add_lora(name, path)


@dataclass
class Resolved:
    """The adapters --lora-resolver-dir's resolver loaded, and the lock that orders every
    load and unload (the routes' and the resolver's) of one server."""

    loaded: dict[str, LoRAModule] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def resolved(ctx: ServerContext) -> Resolved:
    """ctx's Resolved, made on first use (kept on the context it belongs to)."""
    state = ctx.__dict__.get("_lora_resolved")
    if state is None:
        state = ctx.__dict__["_lora_resolved"] = Resolved()
    return state


def served_adapters(ctx: ServerContext) -> list[LoRAModule]:
    """Every adapter clients may name: ctx.loras in load order, then the resolver's."""
    extra = [m for name, m in resolved(ctx).loaded.items() if name not in ctx.loras]
    return [*ctx.loras.values(), *extra]


def is_served(ctx: ServerContext, name: str) -> bool:
    return name in ctx.loras or name in resolved(ctx).loaded


def resolver_dir(ctx: ServerContext) -> str | None:
    config = ctx.engine.config  # None until the engine has loaded
    return getattr(config, "lora_resolver_dir", None) if config is not None else None


def resolvable(ctx: ServerContext, name: str) -> bool:
    """Would the resolver find an adapter of this name (without loading it)?"""
    root = resolver_dir(ctx)
    return root is not None and find_adapter(root, name) is not None


def _unknown_model(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "model")


async def load_on_first_use(ctx: ServerContext, name: str) -> None:
    """Make the adapter `name` served, loading it from --lora-resolver-dir where it is not
    yet; APIError (the unknown model's 404, 400 where it cannot load) otherwise."""
    state = resolved(ctx)
    if is_served(ctx, name):
        return
    async with state.lock:  # one load at a time: two first requests load it once
        if is_served(ctx, name):
            return
        root = resolver_dir(ctx)
        path = find_adapter(root, name) if root is not None else None
        if path is None:
            raise _unknown_model(name)
        try:
            await engine_call(ctx, functools.partial(add_lora, name, str(path)))
        except LoRAError as e:
            logger.warning("LoRA adapter %s from %s (resolver) not loaded: %s", name, path, e)
            reason = f": {e}" if isinstance(e, LoRAFull) else "."  # LoRAFull names no path
            raise APIError(400, f"LoRA adapter '{name}' was found but could not be "
                           f"loaded{reason}") from e  # fmt: skip
        state.loaded[name] = LoRAModule(name, str(path))
    logger.info("loaded LoRA adapter %s from %s (resolver, on first use)", name, path)


async def engine_call(ctx: ServerContext, fn):
    try:
        return await ctx.engine.call(fn)
    except EngineNotReady as e:
        raise APIError(503, str(e)) from e
    except EngineFailed as e:
        raise APIError(500, str(e)) from e
