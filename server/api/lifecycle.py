"""Readiness and graceful drain.

On SIGTERM the server turns not-ready (/ready 503) and the requests in flight run to
completion, bounded by --shutdown-timeout. Only then does uvicorn stop and the process
exit 0. Requests that still arrive while it drains are served too, with `Connection:
close`: they come on keep-alive connections opened before the pod left the Service's
endpoints, and kube-proxy never moves an open connection, so a 503 there would fail a
request that the next connection would have sent to a live pod. That is what lets a
rolling update drop nothing.
"""

import asyncio
import logging
import signal

import uvicorn

logger = logging.getLogger(__name__)

# Paths whose requests a drain waits for; everything else is instant.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class Lifecycle:
    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Stop taking work and wait for in-flight requests; False if time ran out."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


def _closing(send):
    """send, with `Connection: close` on the response: the client's next request opens a
    new connection, which the Service routes to a pod that is not draining."""

    async def closing_send(message):
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing_send


class GateMiddleware:
    """Counts generation requests in flight (a streamed one counts until its last byte is
    sent); while draining, every /v1 response closes its connection."""

    def __init__(self, app, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.lifecycle.draining:
            send = _closing(send)
        if scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM drains first (see the module doc). SIGINT keeps uvicorn's
    behaviour: stop now."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, shutdown_timeout: float,
                 on_timeout):  # fmt: skip
        super().__init__(config)
        self._lifecycle = lifecycle
        self._shutdown_timeout = shutdown_timeout
        self._on_timeout = on_timeout  # coroutine function: ends what still runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM:
            return super().handle_exit(sig, frame)
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and
        # the process would die by SIGTERM instead of exiting 0.
        if self._drain_task is None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        logger.info("SIGTERM: draining %d in-flight request(s), up to %.0f s",
                    self._lifecycle.in_flight, self._shutdown_timeout)  # fmt: skip
        if not await self._lifecycle.drain(self._shutdown_timeout):
            logger.warning("shutdown timeout: ending %d request(s) still in flight",
                           self._lifecycle.in_flight)  # fmt: skip
            await self._on_timeout()
        self.should_exit = True
