"""What both generation routes do around the engine: admission (model name, queue bound,
engine rejections as 400), waiting for a result while watching for the client to leave,
and the error event of a stream that fails after its header went out."""

import asyncio

from batchpilot.server.api import lora_resolver
from batchpilot.server.api.context import ServerContext
from batchpilot.server.api.errors import APIError, error_body
from batchpilot.server.api.responses import sse
from batchpilot.server.engine.client import (
    EngineFailed,
    EngineNotReady,
    RequestFailed,
    RequestStream,
)

# Seconds a client told 429 should wait: about the time a CPU engine needs to move a
# queue slot; short enough that a retrying client keeps the queue fed.
RETRY_AFTER_SECONDS = 1


def check_model(ctx: ServerContext, requested: str | None) -> tuple[str, str | None]:
    """-> (the model responses name, the LoRA adapter to run or None for the base model).
    An adapter is chosen by its name in `model`, as in vLLM: a loaded one, or one that
    --lora-resolver-dir has (start() loads it on first use)."""
    if requested is None or requested == ctx.served_model_name:
        return ctx.served_model_name, None
    if lora_resolver.is_served(ctx, requested):
        return requested, requested
    if ctx.engine.config is None:  # still loading: the resolver's directory is not known yet
        require_engine(ctx)
    if lora_resolver.resolvable(ctx, requested):
        return requested, requested
    # vLLM answers an unknown model (or adapter) 404 NotFoundError, param "model".
    raise APIError(404, f"The model `{requested}` does not exist.", "model")


def require_engine(ctx: ServerContext) -> None:
    if ctx.engine.failure is not None:
        raise APIError(500, f"The engine failed and cannot serve requests: {ctx.engine.failure!r}")
    if not ctx.engine.is_loaded:
        raise APIError(503, "The model is still loading", headers={"Retry-After": "5"})


async def start(ctx: ServerContext, requests: list[tuple], lora_name: str | None = None
                ) -> RequestStream:  # fmt: skip
    """Hand the engine requests over, all for the base model or all for adapter lora_name;
    the HTTP errors for everything that can refuse them."""
    engine = ctx.engine
    require_engine(ctx)
    if lora_name is not None:  # an adapter the resolver has: loaded on its first request
        await lora_resolver.load_on_first_use(ctx, lora_name)
    # Counted in sequences (prompts x n), as the engine queues them, and refused whole.
    if len(requests) > ctx.max_queue_len:
        raise APIError(400, f"The request asks for {len(requests)} sequences (prompts x n) "
                       f"but at most {ctx.max_queue_len} may wait at once.", "n")  # fmt: skip
    if engine.num_waiting + len(requests) > ctx.max_queue_len:
        raise APIError(429, f"Too many requests waiting ({engine.num_waiting} sequences, and "
                       f"this request adds {len(requests)}; the limit is {ctx.max_queue_len}). "
                       "Retry later.", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})  # fmt: skip
    try:
        return await engine.submit(requests, lora_name)
    except EngineNotReady as e:
        raise APIError(503, str(e)) from e
    except EngineFailed as e:
        raise APIError(500, str(e)) from e
    except ValueError as e:  # RequestRejected (e.g. an adapter since unloaded), SamplingParams
        raise APIError(400, str(e)) from e


async def _until_disconnected(receive) -> None:
    # After the body has been read, the server's next message is http.disconnect: sent when
    # the client goes away, or once the response is complete.
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect(stream: RequestStream, receive) -> dict | None:
    """request id -> final RequestOutput, or None if the client disconnected first; the
    unfinished requests are aborted then, freeing their KV blocks at the next step."""
    final: dict = {}

    async def consume():
        async for outs in stream:
            for out in outs:
                final[out.request_id] = out

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        consumer.cancel()
        stream.close()
    if not consumer.cancelled() and consumer.done():
        try:
            consumer.result()
        except EngineFailed as e:
            raise APIError(503, str(e)) from e
        except RequestFailed as e:
            raise APIError(500, str(e)) from e
        return final
    return None


def stream_error_event(error: Exception) -> str:
    """An error after the 200 header went out: sent as an SSE event, as vLLM does."""
    return sse(error_body(503 if isinstance(error, EngineFailed) else 500, str(error)))
