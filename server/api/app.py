"""The FastAPI apps and `batchpilot serve`.

uvicorn starts serving at once; the engine loads on its own thread meanwhile, so /health
answers during a long load and /ready turns 200 only when the model is loaded.

/admin/* is a second app on its own port (--admin-port), served by the same event loop:
the public port, and so the Service in front of it, never routes to it. It exists only
when an admin token is configured.
"""

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batchpilot import __version__, names
from batchpilot.server.api import admin, chat, completions, lora, probes, tokenize
from batchpilot.server.api.auth import ApiKeyMiddleware
from batchpilot.server.api.body_limit import BodyLimitMiddleware
from batchpilot.server.api.context import ServerContext
from batchpilot.server.api.errors import install_error_handlers
from batchpilot.server.api.lifecycle import DrainingServer, GateMiddleware, Lifecycle
from batchpilot.server.api.loading import IMPORT_STAGE, loading_progress
from batchpilot.server.api.lora_modules import LoRAModule
from batchpilot.server.api.metrics import ServerMetrics, SloTargets, slo_targets
from batchpilot.server.api.stats_log import log_stats_forever
from batchpilot.server.api.timeline import FirstToken
from batchpilot.server.config import ConfigError, EngineConfig, config_from_args
from batchpilot.server.engine.async_engine import AsyncEngine
from batchpilot.server.engine.client import EngineClient
from batchpilot.server.engine.engine_process import EngineProcessClient
from batchpilot.server.engine.stats import EngineStats

logger = logging.getLogger("batchpilot.serve")

# Seconds uvicorn waits for connections after the drain, before cancelling them: the drain
# itself (--shutdown-timeout) already waited for the requests.
CONNECTION_CLOSE_GRACE = 5.0
# An admin body is one small JSON object of knobs.
ADMIN_BODY_BYTES = 64 << 10


def build_app(
    make_engine: Callable[[], object],
    served_model_name: str,
    *,
    api_key: str | None = None,
    admin_token: str | None = None,
    max_queue_len: int = 1024,
    max_request_body_bytes: int = 4 << 20,
    stream_stall_timeout: float = 60.0,
    log_stats_interval: float = 0.0,
    on_loaded: Callable[[EngineClient], None] | None = None,
    on_load_failed: Callable[[BaseException], None] | None = None,
    lora_modules: tuple[LoRAModule, ...] = (),
    preload_lora_modules: tuple[LoRAModule, ...] = (),
    engine_process: bool = False,
    slo: SloTargets | None = None,
) -> FastAPI:
    """The public app. make_engine() -> LLMEngine runs on the engine thread when the app
    starts (in the engine process, with engine_process), and loads lora_modules;
    app.state.context is what build_admin_app shares."""
    metrics: ServerMetrics | None = None
    first_token = FirstToken()

    def on_step(step) -> None:
        metrics.observe_step(step)
        first_token.observe(step)

    engine: EngineClient = (
        EngineProcessClient(make_engine, on_step, setup_process=configure_logging)
        if engine_process
        else AsyncEngine(make_engine, on_step)
    )
    metrics = ServerMetrics(served_model_name, lambda: engine.stats, slo)
    lifecycle = Lifecycle()
    context = ServerContext(engine, lifecycle, metrics, served_model_name, admin_token,
                            max_queue_len, stream_stall_timeout)  # fmt: skip
    # Known before they load: until then every request gets 503, and a failed load ends
    # the server.
    context.loras.update((m.name, m) for m in lora_modules)
    for module in preload_lora_modules:  # in load order, as /v1/models lists them
        context.loras.setdefault(module.name, module)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        tasks = [asyncio.create_task(_after_load(engine, on_loaded, on_load_failed,
                                                 context, preload_lora_modules))]  # fmt: skip
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
    for module in (completions, chat, tokenize, probes):
        app.include_router(module.router)
    # Added innermost first: the drain gate answers before auth, auth before the body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(GateMiddleware, lifecycle=lifecycle)
    return app


def build_admin_app(context: ServerContext) -> FastAPI:
    """/admin/* and the LoRA load/unload routes for the operator, over the public app's
    engine; its own token guards them."""
    app = FastAPI(title="batchpilot admin", version=__version__, openapi_url=None)
    app.state.context = context
    install_error_handlers(app)
    app.include_router(admin.router)
    app.include_router(lora.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=ADMIN_BODY_BYTES)
    return app


class HeadLimitProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on a request's head (request line and
    headers): past config.h11_max_incomplete_event_size bytes, 431 and the connection closed.

    httptools (llhttp) bounds no head, and uvicorn applies that option to h11 alone: a client
    could make the server buffer a header flood of any size. h11 bounds it, but costs a third
    more CPU per request (docs/api.md). The parser is fed no more of a head than
    the limit allows. One shortfall: a read that ends one request and starts the next counts
    none of the next one's head, which can then hold one read (256 KiB) more."""

    def __init__(self, config: uvicorn.Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.max_head_bytes = config.h11_max_incomplete_event_size
        self.head_bytes: int | None = 0  # of the request being received; None in its body

    def data_received(self, data: bytes) -> None:
        if self.head_bytes is None:
            return super().data_received(data)
        room = self.max_head_bytes - self.head_bytes
        self.head_bytes += min(len(data), room)
        super().data_received(data[:room])
        if len(data) <= room or self.transport.is_closing():  # closing: the parser's 400
            return
        if self.head_bytes == self.max_head_bytes:  # the same head, still incomplete
            self._refuse_head()
        else:  # the head ended (and maybe its request) within the room
            self.data_received(data[room:])

    def on_headers_complete(self) -> None:
        self.head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.head_bytes = 0

    def _refuse_head(self) -> None:
        self.logger.warning("Request line and headers over %d bytes: 431.", self.max_head_bytes)
        reason = b"Request Header Fields Too Large"
        head = [b"HTTP/1.1 431 ", reason, b"\r\n"]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n",
                 b"content-length: %d\r\n\r\n" % len(reason), reason]  # fmt: skip
        self.transport.write(b"".join(head))
        self.transport.close()


def uvicorn_config(app: FastAPI, args, port: int, **options) -> uvicorn.Config:
    """Both listeners parse with HeadLimitProtocol: the admin port reads headers before the
    token is checked."""
    return uvicorn.Config(app, host=args.host, port=port, log_config=None,
                          http=HeadLimitProtocol,
                          h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                          **options)  # fmt: skip


class SideServer(uvicorn.Server):
    """uvicorn for the admin app: it leaves the signals to the public server, whose SIGTERM
    drains, and is stopped by it."""

    def capture_signals(self):
        return contextlib.nullcontext()


async def _after_load(engine: EngineClient, on_loaded, on_load_failed, context: ServerContext,
                      preloaded: tuple[LoRAModule, ...]) -> None:  # fmt: skip
    try:
        await engine.loaded
        await lora.forget_unloaded(context, preloaded)
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


def _make_engine(config, lora_modules: tuple[LoRAModule, ...],
                 preload_lora_modules: tuple[LoRAModule, ...], served: str):  # fmt: skip
    """The engine `serve` runs (module-level, so that it pickles to an engine process)."""
    with loading_progress(served) as on_stage:
        on_stage(IMPORT_STAGE)
        from batchpilot.server.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, on_stage=on_stage)
    lora.load_at_start(engine, lora_modules, served)
    lora.preload(engine, preload_lora_modules, served)
    return engine


def serve(args) -> int:
    configure_logging()
    try:
        config = config_from_args(args)
    except ConfigError as e:
        logger.error("invalid configuration: %s", e)
        return 2
    served = args.served_model_name or default_served_model_name(args.model)
    config.served_model_name = served
    preload = tuple(m for m in args.preload_lora_modules if m not in args.lora_modules)
    config.enable_lora = config.enable_lora or bool(args.lora_modules) or bool(preload)
    url = f"http://{args.host}:{args.port}"
    failed: list[BaseException] = []
    server: DrainingServer | None = None

    make_engine = functools.partial(_make_engine, config, tuple(args.lora_modules), preload,
                                    served)  # fmt: skip

    def on_loaded(engine: EngineClient) -> None:
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
        stream_stall_timeout=args.stream_stall_timeout,
        log_stats_interval=args.log_stats_interval,
        on_loaded=on_loaded,
        on_load_failed=on_load_failed,
        lora_modules=tuple(args.lora_modules),
        preload_lora_modules=preload,
        engine_process=args.engine_process,
        slo=slo_targets(args),
    )

    async def end_remaining() -> None:
        await app.state.context.engine.shutdown()

    uv_config = uvicorn_config(
        app, args, args.port, timeout_graceful_shutdown=CONNECTION_CLOSE_GRACE,
        limit_concurrency=args.limit_concurrency, timeout_keep_alive=args.timeout_keep_alive,
    )  # fmt: skip
    server = DrainingServer(uv_config, app.state.context.lifecycle, args.shutdown_timeout,
                            end_remaining)  # fmt: skip
    admin_server = None
    if args.admin_token:
        admin_app = build_admin_app(app.state.context)
        admin_server = SideServer(uvicorn_config(admin_app, args, args.admin_port,
                                                 lifespan="off"))  # fmt: skip
        logger.info("admin API on http://%s:%d/admin", args.host, args.admin_port)
    with asyncio.Runner(loop_factory=uv_config.get_loop_factory()) as runner:
        runner.run(_serve_both(server, admin_server, failed))
    return 1 if failed else 0


async def _serve_both(server: uvicorn.Server, admin_server: uvicorn.Server | None,
                      failed: list) -> None:  # fmt: skip
    """Run the public server, and the admin one beside it for as long as it runs. If the
    admin listener cannot start (its port is taken), the whole server exits with an error
    rather than serve without the operator's control path."""
    if admin_server is None:
        return await server.serve()

    def admin_ended(task: asyncio.Task) -> None:
        if not server.should_exit:
            failed.append(RuntimeError("the admin listener stopped"))
            logger.error("the admin listener on port %d stopped; exiting",
                         admin_server.config.port)  # fmt: skip
            server.should_exit = True

    admin_task = asyncio.create_task(admin_server.serve())
    admin_task.add_done_callback(admin_ended)
    try:
        await server.serve()
    finally:
        admin_server.should_exit = True
        with contextlib.suppress(BaseException):  # a failed start already said why
            await admin_task
