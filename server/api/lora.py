"""LoRA adapters: vLLM's load and unload routes, on the admin port behind the admin token
(vLLM serves them on the public port when VLLM_ALLOW_RUNTIME_LORA_UPDATING is set; here a
runtime change is the operator's, as /admin/config is), and the start-up loading of
--lora-modules. Adapters of --lora-resolver-dir load on first use in lora_resolver.py,
under the lock these routes take too.

A loaded adapter is registered: the engine keeps its name and path and at most
--max-cpu-loras of them in host memory, reading one again when a request wants it
(server/lora/manager.py), so neither the load nor a request fails for --max-cpu-loras.

The engine is the authority on what is registered; ServerContext.loras mirrors it on the event
loop so that a request finds its adapter without a round trip to the engine thread, and
lora_resolver.Resolved.loaded does for the adapters the resolver loaded. Only these
routes, the resolver and the start-up change either, always the engine first.

Errors are vLLM's, word for word where vLLM has the case (serving_models.py):
- load: 400 InvalidUserInput "Both 'lora_name' and 'lora_path' must be provided." and
  "The lora adapter '<name>' has already been loaded."; 404 NotFoundError "Loading lora
  <name> failed: No adapter found for <path>"; an adapter that cannot serve (corrupt,
  another base model's, too high a rank, MAX_REGISTERED_LORAS reached) is 400 BadRequestError
  with the reason (older vLLM said 400 too; recent versions say 500, which blames the
  server for the adapter's fault and reads as "retry" to the operator);
- unload: 400 InvalidUserInput "'lora_name' needs to be provided to unload a LoRA
  adapter."; 404 NotFoundError "The lora adapter '<name>' cannot be found.";
- first use (lora_resolver.py): vLLM's resolver errors.
"""

import functools
import logging
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batchpilot.server.api.admin import require_admin
from batchpilot.server.api.context import ServerContext
from batchpilot.server.api.errors import INVALID_USER_INPUT, APIError
from batchpilot.server.api.lora_modules import (
    MAX_LORA_PATH_CHARS,
    LoRAModule,
    lora_name_error,
    lora_path_error,
)
from batchpilot.server.api.lora_resolver import add_lora, engine_call, is_served, resolved
from batchpilot.server.lora import LoRAError, LoRANotFound

logger = logging.getLogger(__name__)
router = APIRouter()


# An engine call, module-level so that it pickles to an engine process.
def _remove_lora(name: str, engine) -> None:
    engine.remove_lora(name)


# Missing or empty fields get vLLM's InvalidUserInput; the bound only keeps a huge string
# from being held (the name's own rule is lora_name_error's).
_Text = Annotated[str | None, Field(max_length=MAX_LORA_PATH_CHARS)]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's optional fields change nothing here

    lora_name: _Text = None
    lora_path: _Text = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's lora_int_id: names suffice here

    lora_name: _Text = None


def adapter_dir_error(module: LoRAModule, served_model_name: str) -> str | None:
    """What is wrong with serving module before the engine reads it, or None."""
    if module.name == served_model_name:
        return f"The LoRA adapter name '{module.name}' is the base model's name."
    # hf://org/name is found in the local HF cache by the engine, as models are.
    if not module.path.startswith("hf://") and not Path(module.path).is_dir():
        return f"The LoRA adapter path '{module.path}' is not a directory."
    return None


def _load(engine, module: LoRAModule, served_model_name: str) -> None:
    """One start-up adapter into the engine; LoRAError says why it cannot serve."""
    error = adapter_dir_error(module, served_model_name)
    if error:
        raise LoRAError(error)
    engine.add_lora(module.name, module.path)
    logger.info("loaded LoRA adapter %s from %s", module.name, module.path)


def load_at_start(engine, modules: list[LoRAModule], served_model_name: str) -> None:
    """--lora-modules, on the engine thread once the engine is built: a bad adapter fails
    the start, naming it."""
    for module in modules:
        try:
            _load(engine, module, served_model_name)
        except LoRAError as e:
            raise LoRAError(f"--lora-modules {module.name}={module.path}: {e}") from e


def preload(engine, modules: list[LoRAModule], served_model_name: str) -> None:
    """--preload-lora-modules, after --lora-modules: a bad adapter is logged and left out,
    and the replica serves the others. The operator declares these for every replica it
    starts; one corrupt adapter must not keep them all from starting (it reports the
    refusal per replica when its sync asks again)."""
    for module in modules:
        try:
            _load(engine, module, served_model_name)
        except LoRAError as e:
            logger.error("LoRA adapter %s from %s left out: %s", module.name, module.path, e)


def _list_loras(engine) -> list[str]:
    return engine.list_loras()


async def forget_unloaded(ctx: ServerContext, modules: tuple[LoRAModule, ...]) -> None:
    """Once the engine is loaded: drop from ctx.loras the preloaded adapters it left out, so
    that their requests get the unknown-model 400 rather than a failure in the engine."""
    if not modules:
        return
    loaded = set(await ctx.engine.call(_list_loras))
    for module in modules:
        if module.name not in loaded:
            ctx.loras.pop(module.name, None)


async def _body(request: Request, model: type[BaseModel]) -> BaseModel:
    # Parsed here, after require_admin: no token, no parsing.
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e


def _invalid(message: str) -> APIError:
    return APIError(400, message, error_type=INVALID_USER_INPUT)


def _no_adapter_at(module: LoRAModule) -> bool:
    """No PEFT adapter at a local path (hf:// is the engine's to look up in the cache)."""
    if module.path.startswith("hf://"):
        return False
    return not (Path(module.path) / "adapter_config.json").is_file()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request, ctx: ServerContext = Depends(require_admin)):
    body = await _body(request, LoadLoRAAdapterRequest)
    if not body.lora_name or not body.lora_path:
        raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
    for param, error in (("lora_name", lora_name_error(body.lora_name)),
                         ("lora_path", lora_path_error(body.lora_path))):  # fmt: skip
        if error:
            raise APIError(400, error, param)
    module = LoRAModule(body.lora_name, body.lora_path)
    async with resolved(ctx).lock:
        if is_served(ctx, module.name):
            raise _invalid(f"The lora adapter '{module.name}' has already been loaded.")
        if module.name == ctx.served_model_name:
            raise APIError(400, f"The LoRA adapter name '{module.name}' is the base model's "
                           "name.", "lora_name")  # fmt: skip
        if _no_adapter_at(module):
            raise APIError(404, f"Loading lora {module.name} failed: No adapter found for "
                           f"{module.path}")  # fmt: skip
        try:
            # The engine thread reads and checks the files between two steps.
            await engine_call(ctx, functools.partial(add_lora, module.name, module.path))
        except LoRAError as e:
            raise APIError(400, str(e)) from e
        ctx.loras[module.name] = module
    logger.info("admin: loaded LoRA adapter %s from %s", module.name, module.path)
    return PlainTextResponse(f"Success: LoRA adapter '{module.name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, ctx: ServerContext = Depends(require_admin)):
    name = (await _body(request, UnloadLoRAAdapterRequest)).lora_name
    if not name:
        raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
    state = resolved(ctx)
    async with state.lock:
        try:
            await engine_call(ctx, functools.partial(_remove_lora, name))
        except LoRANotFound as e:
            ctx.loras.pop(name, None)
            state.loaded.pop(name, None)
            raise APIError(404, f"The lora adapter '{name}' cannot be found.") from e
        except LoRAError as e:  # LoRAInUse among them: requests for it still wait or run
            raise APIError(400, str(e)) from e
        ctx.loras.pop(name, None)
        state.loaded.pop(name, None)
    logger.info("admin: unloaded LoRA adapter %s", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
