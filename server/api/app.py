"""The FastAPI app and `batchpilot serve`.

uvicorn starts serving at once; the engine loads on its own thread meanwhile, so /health
answers during a long load and /ready turns 200 only when the model is loaded.
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from batchpilot import __version__, names
from batchpilot.server.api import admin, chat, completions, probes, tokenize
from batchpilot.server.api.auth import ApiKeyMiddleware
from batchpilot.server.api.body_limit import BodyLimitMiddleware
from batchpilot.server.api.context import ServerContext
from batchpilot.server.api.errors import install_error_handlers
from batchpilot.server.api.lifecycle import DrainingServer, GateMiddleware, Lifecycle
from batchpilot.server.api.loading import loading_progress
from batchpilot.server.api.metrics import ServerMetrics
from batchpilot.server.api.stats_log import log_stats_forever
from batchpilot.server.async_engine import AsyncEngine
from batchpilot.server.config import ConfigError, EngineConfig, config_from_args
from batchpilot.server.stats import EngineStats

logger = logging.getLogger("batchpilot.serve")

# Seconds uvicorn waits for connections after the drain, before cancelling them: the drain
# itself (--shutdown-timeout) already waited for the requests.
CONNECTION_CLOSE_GRACE = 5.0


def build_app(
    make_engine: Callable[[], object],
    served_model_name: str,
    *,
    api_key: str | None = None,
    admin_token: str | None = None,
    max_queue_len: int = 1024,
    max_request_body_bytes: int = 4 << 20,
    log_stats_interval: float = 0.0,
    on_loaded: Callable[[AsyncEngine], None] | None = None,
    on_load_failed: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """make_engine() -> LLMEngine runs on the engine thread when the app starts."""
    metrics: ServerMetrics | None = None

    def on_step(step) -> None:
        metrics.observe_step(step)

    engine = AsyncEngine(make_engine, on_step)
    metrics = ServerMetrics(served_model_name, lambda: engine.stats)
    lifecycle = Lifecycle()
    context = ServerContext(engine, lifecycle, metrics, served_model_name, admin_token,
                            max_queue_len)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        tasks = [asyncio.create_task(_after_load(engine, on_loaded, on_load_failed))]
        if log_stats_interval > 0:
            tasks.append(asyncio.create_task(log_stats_forever(lambda: engine.stats,
                                                               log_stats_interval)))  # fmt: skip
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await engine.shutdown()

    app = FastAPI(title="batchpilot", version=__version__, lifespan=lifespan)
    app.state.context = context
    install_error_handlers(app)
    for module in (completions, chat, tokenize, probes, admin):
        app.include_router(module.router)
    # Added innermost first: the drain gate answers before auth, auth before the body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(GateMiddleware, lifecycle=lifecycle)
    return app


async def _after_load(engine: AsyncEngine, on_loaded, on_load_failed) -> None:
    try:
        await engine.loaded
    except BaseException as e:
        if on_load_failed is not None:
            on_load_failed(e)
        return
    if on_loaded is not None:
        on_loaded(engine)


def default_served_model_name(model: str | None) -> str:
    if model in (None, "bundled"):
        return names.DEFAULT_SERVED_MODEL_NAME
    return Path(model.rstrip("/")).name


def ready_line(url: str, model: str, config: EngineConfig, stats: EngineStats) -> str:
    """The one line an operator looks for: where, what, and how much fits at once."""
    concurrency = stats.num_kv_blocks * stats.block_size / config.max_model_len
    return (
        f"Ready at {url} serving {model}: {stats.num_kv_blocks} KV blocks of "
        f"{stats.block_size} tokens ({stats.kv_cache_dtype}), maximum concurrency "
        f"{concurrency:.2f}x for {config.max_model_len}-token requests, "
        f"max_num_seqs {config.max_num_seqs}"
    )


def configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )


def serve(args) -> int:
    configure_logging()
    try:
        config = config_from_args(args)
    except ConfigError as e:
        logger.error("invalid configuration: %s", e)
        return 2
    served = args.served_model_name or default_served_model_name(args.model)
    config.served_model_name = served
    url = f"http://{args.host}:{args.port}"
    failed: list[BaseException] = []
    server: DrainingServer | None = None

    def make_engine():
        from batchpilot.server.engine import LLMEngine

        with loading_progress(served) as on_stage:
            return LLMEngine(config, on_stage=on_stage)

    def on_loaded(engine: AsyncEngine) -> None:
        logger.info(ready_line(url, served, engine.config, engine.stats))

    def on_load_failed(error: BaseException) -> None:
        failed.append(error)
        logger.error("loading the model failed: %s", error)
        server.should_exit = True

    logger.info("loading %s with %s", served, config.public())
    app = build_app(
        make_engine,
        served,
        api_key=args.api_key,
        admin_token=args.admin_token,
        max_queue_len=args.max_queue_len,
        max_request_body_bytes=args.max_request_body_bytes,
        log_stats_interval=args.log_stats_interval,
        on_loaded=on_loaded,
        on_load_failed=on_load_failed,
    )

    async def end_remaining() -> None:
        await app.state.context.engine.shutdown()

    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                               timeout_graceful_shutdown=CONNECTION_CLOSE_GRACE)  # fmt: skip
    server = DrainingServer(uv_config, app.state.context.lifecycle, args.shutdown_timeout,
                            end_remaining)  # fmt: skip
    server.run()
    return 1 if failed else 0
