"""The activator: where the Service of an InferenceService scaled to zero sends its traffic.

It holds each request, asks for a replica (``wake``), waits until one is Ready
(``endpoints``) and then forwards the held requests to it in arrival order, streaming the
answers back. One activator serves every service; the Host header says which one a request
is for, and ``resolve`` says whether the activator acts for it at all: a Host it refuses
gets a 404 at once and leaves nothing behind (no hold, no wake, no state, no metric
series). The Kubernetes side (``resolve``, ``wake``, ``endpoints``) is passed in as plain
callables, sync or async: kube.py has the real ones, tests their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

import aiohttp
import yarl
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from batchpilot.operator.activator.hold_queue import HoldQueue, QueueFull
from batchpilot.operator.activator.hosts import Target, host_name
from batchpilot.operator.activator.listener import LimitedServer, Runner

logger = logging.getLogger(__name__)

MAX_HELD_PER_SERVICE = 256
HOLD_TIMEOUT_SECONDS = 300.0
MAX_BODY_BYTES = 4 << 20  # the server's own bound (--max-request-body-bytes)
# The bodies held at once, over every service: the per-service count alone would let 256
# requests of 4 MiB each past a 512 MiB pod limit, and an OOM kill loses every held request.
MAX_HELD_BYTES = 128 << 20
# Services remembered at once (only those resolve() accepts make an entry): entries with
# nothing held are dropped past this, and a new one is refused (503) when all hold requests.
MAX_SERVICES = 1024
# Connections at once; past this a new one gets a 503 before a byte of it is read. Each
# costs a few KiB of buffers, and a client holding many open must not starve the rest.
MAX_CONNECTIONS = 4096
# A request body must arrive within this (a slow sender holds its bytes in our memory);
# beyond, 408. Idle keep-alive connections are closed after KEEPALIVE_SECONDS.
BODY_READ_TIMEOUT_SECONDS = 30.0
KEEPALIVE_SECONDS = 15.0
# While requests are held, `wake` is asked again this often (an annotation patch whose
# first attempt failed, or that the operator missed, gets another chance) ...
WAKE_INTERVAL_SECONDS = 5.0
# ... and `endpoints` at most this often: a held request is forwarded within this of its
# replica turning Ready.
POLL_INTERVAL_SECONDS = 0.5
# What a client refused for a full queue is told to wait: a cold start takes tens of
# seconds, so a retry sooner mostly finds the queue still full.
RETRY_AFTER_SECONDS = 5
RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_SECONDS)}
CONNECT_TIMEOUT_SECONDS = 10.0
BODY_CHUNK_BYTES = 64 << 10

# Outcomes of batchpilot_activator_requests_total.
FORWARDED = "forwarded"
REJECTED_FULL = "rejected_full"
TIMED_OUT = "timed_out"
DISCONNECTED = "disconnected"
NOT_FOUND = "not_found"
TOO_LARGE = "too_large"
BAD_REQUEST = "bad_request"

# RFC 9110's connection-specific headers: they describe one hop, never the next.
HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
     "trailer", "transfer-encoding", "upgrade"]
)  # fmt: skip
# The types the server's errors carry (vLLM's names), for the statuses the activator sends.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str, headers: dict[str, str] | None = None):
    """An error in OpenAI's shape, the same as the server's (server/api/errors.py, which
    needs FastAPI and so stays out of the operator image)."""
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Refused(Exception):
    """A request the activator answers itself, with an error and the outcome it counts."""

    def __init__(self, status: int, message: str, outcome: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.outcome, self.headers = status, message, outcome, headers

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.headers)


def end_to_end(headers: CIMultiDictProxy[str], *also_drop: str) -> CIMultiDict[str]:
    """The headers minus hop-by-hop ones (those a Connection header names included)."""
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",")}
    drop = HOP_BY_HOP | named | set(also_drop)
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


async def call(fn: Callable, *args):
    """Call a sync or an async callable alike."""
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


class ActivatorMetrics:
    """A registry of its own: tests run several activators in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.held = Gauge(
            "batchpilot_activator_held_requests",
            "Requests held until a replica of the service is Ready",
            ["namespace", "service"],
            registry=self.registry,
        )
        self.requests = Counter(
            "batchpilot_activator_requests",
            "Requests per service by outcome: forwarded, rejected_full, timed_out, "
            "disconnected, too_large, bad_request, not_found (service labels empty: no "
            "service the activator acts for matched)",
            ["namespace", "service", "outcome"],
            registry=self.registry,
        )
        self.hold_seconds = Histogram(
            "batchpilot_activator_hold_seconds",
            "From a request's arrival to its forwarding",
            buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
            registry=self.registry,
        )

    def forget(self, namespace: str, name: str) -> None:
        """Drop a forgotten service's series: they exist only for services it acts for."""
        with contextlib.suppress(KeyError):  # never held
            self.held.remove(namespace, name)
        for outcome in (FORWARDED, REJECTED_FULL, TIMED_OUT, DISCONNECTED, TOO_LARGE,
                        BAD_REQUEST, NOT_FOUND):  # fmt: skip
            with contextlib.suppress(KeyError):  # that outcome never happened
                self.requests.remove(namespace, name, outcome)


@dataclass
class Service:
    """What the activator knows of one service: its held requests and its backends."""

    namespace: str
    name: str
    queue: HoldQueue
    backends: list[str] = field(default_factory=list)
    checked_at: float = float("-inf")  # when `endpoints` last answered
    woken_at: float = float("-inf")  # when `wake` was last asked
    turn: int = 0  # round-robin position over the backends
    poller: asyncio.Task | None = None
    refreshing: asyncio.Lock = field(default_factory=asyncio.Lock)

    def next_backend(self) -> str:
        backend = self.backends[self.turn % len(self.backends)]
        self.turn += 1
        return backend


class Activator:
    """``resolve(hostname, client_ip) -> (namespace, name) | None``: the service a Host
    (without its port) names for a client, if the activator acts for it; None: 404.
    ``wake(namespace, name)``: ask for a replica. ``endpoints(namespace, name) ->
    list[str]``: base URLs of the Ready replicas, like http://10.244.0.7:8000. Each may be
    sync or async."""

    def __init__(
        self,
        resolve: Callable,
        wake: Callable,
        endpoints: Callable,
        *,
        max_held_per_service: int = MAX_HELD_PER_SERVICE,
        hold_timeout: float = HOLD_TIMEOUT_SECONDS,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_held_bytes: int = MAX_HELD_BYTES,
        max_connections: int = MAX_CONNECTIONS,
        body_read_timeout: float = BODY_READ_TIMEOUT_SECONDS,
        wake_interval: float = WAKE_INTERVAL_SECONDS,
        poll_interval: float = POLL_INTERVAL_SECONDS,
        ready: Callable[[], bool] = lambda: True,
    ):
        self.resolve, self.wake, self.endpoints = resolve, wake, endpoints
        self.ready = ready  # /readyz: False until resolve can answer (the watches listed)
        self.max_held_per_service = max_held_per_service
        self.hold_timeout = hold_timeout
        self.max_body_bytes = max_body_bytes
        self.max_held_bytes = max_held_bytes
        self.held_bytes = 0  # bodies in memory: being read, held, or being forwarded
        self.max_connections = max_connections
        self.body_read_timeout = body_read_timeout
        self.wake_interval = wake_interval
        self.poll_interval = poll_interval
        self.metrics = ActivatorMetrics()
        self.services: dict[Target, Service] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self, host: str, port: int) -> web.BaseRunner:
        """Serve on host:port (0: any free port, see the runner's ``addresses``)."""
        # A client that goes away cancels its handler: a held request leaves the queue,
        # a forwarded one closes its upstream connection (the server then aborts it).
        server = LimitedServer(self._route, max_connections=self.max_connections,
                               handler_cancellation=True, keepalive_timeout=KEEPALIVE_SECONDS)  # fmt: skip
        runner = Runner(server, self._close, shutdown_timeout=5.0)
        await runner.setup()
        self._open_session()
        await web.TCPSite(runner, host, port).start()
        return runner

    async def _route(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "GET" and request.path == "/healthz":
            return await self._healthz(request)
        if request.method == "GET" and request.path == "/readyz":
            return web.json_response({}, status=200 if self.ready() else 503)
        if request.method == "GET" and request.path == "/metrics":
            return await self._metrics(request)
        return await self._proxy(request)

    def _open_session(self) -> None:
        # No cookie jar: one session serves every client. No decompression: bodies pass
        # through byte for byte, Content-Length and Content-Encoding stay true.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_SECONDS),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
        )

    async def _close(self) -> None:
        for service in self.services.values():
            if service.poller:
                service.poller.cancel()
        if self._session:
            await self._session.close()

    async def _healthz(self, _: web.BaseRequest) -> web.Response:
        return web.json_response({})

    async def _metrics(self, _: web.BaseRequest) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ one request

    async def _proxy(self, request: web.BaseRequest) -> web.StreamResponse:
        if not request.raw_path.startswith("/"):  # absolute-form or '*': not for a server
            self._count(None, BAD_REQUEST)
            return error_response(400, "The request target must be a path (origin-form)")
        if not request.path.startswith("/v1/"):
            self._count(None, NOT_FOUND)
            return error_response(404, f"Not found: {request.path}")
        if request.method not in ("GET", "POST"):
            return error_response(
                405, f"Method not allowed: {request.method}", {"Allow": "GET, POST"}
            )
        try:
            service = await self._service_of(request)
        except Refused as refused:
            self._count(None, refused.outcome)
            return refused.response()
        except Exception as e:  # not synced, or the API server: a retry may well succeed
            logger.warning("resolving %r: %r", request.host, e)
            return error_response(503, f"Could not look up the service of {request.host!r}")
        if service is None:
            self._count(None, NOT_FOUND)
            return error_response(404, f"No service at zero answers to the host {request.host!r}")
        body = bytearray()  # counted in held_bytes from its first byte until forwarded
        try:
            return await self._hold_and_forward(request, service, body)
        finally:
            self.held_bytes -= len(body)

    async def _hold_and_forward(self, request: web.BaseRequest, service: Service,
                                body: bytearray) -> web.StreamResponse:  # fmt: skip
        arrived = time.monotonic()
        try:
            await self._read_body(request, body)
            backend = await self._backend_for(service, arrived)
        except Refused as refused:
            self._count(service, refused.outcome)
            return refused.response()
        except asyncio.CancelledError:
            self._count(service, DISCONNECTED)
            raise
        self._count(service, FORWARDED)
        self.metrics.hold_seconds.observe(time.monotonic() - arrived)
        return await self._forward(request, bytes(body), backend)

    async def _read_body(self, request: web.BaseRequest, body: bytearray) -> None:
        """Read the body into ``body``, each chunk counted at once against the service's
        bound (413) and every body in memory (429); 408 if it is slower than the timeout."""
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise Refused(413, f"The request body exceeds {limit} bytes", TOO_LARGE)
        try:
            async with asyncio.timeout(self.body_read_timeout):
                async for chunk in request.content.iter_chunked(BODY_CHUNK_BYTES):
                    if len(body) + len(chunk) > limit:
                        raise Refused(413, f"The request body exceeds {limit} bytes", TOO_LARGE)
                    if self.held_bytes + len(chunk) > self.max_held_bytes:
                        message = f"{self.held_bytes} bytes of requests are already in memory"
                        raise Refused(429, message, REJECTED_FULL, RETRY_AFTER)
                    body += chunk
                    self.held_bytes += len(chunk)
        except TimeoutError:
            message = f"The request body did not arrive within {self.body_read_timeout:g} s"
            raise Refused(408, message, BAD_REQUEST) from None

    async def _service_of(self, request: web.BaseRequest) -> Service | None:
        target = await call(self.resolve, host_name(request.host), request.remote or "")
        if target is None:
            return None
        if target not in self.services:
            if len(self.services) >= MAX_SERVICES:
                self._forget_idle_services()
            if len(self.services) >= MAX_SERVICES:
                raise Refused(503, "Too many services are waiting for replicas", REJECTED_FULL)
            queue = HoldQueue(self.max_held_per_service)
            self.services[target] = Service(*target, queue=queue)
        return self.services[target]

    def _forget_idle_services(self) -> None:
        for target, service in list(self.services.items()):
            if not service.queue and (service.poller is None or service.poller.done()):
                del self.services[target]
                self.metrics.forget(*target)

    async def _backend_for(self, service: Service, arrived: float) -> str:
        """A Ready backend at once when there is one and nothing is held before this
        request; else hold it until one is, or until the hold timeout."""
        if not service.queue and await self._refresh(service):
            return service.next_backend()
        try:
            future = service.queue.hold()
        except QueueFull:
            message = f"{service.queue.limit} requests are already waiting for a replica"
            raise Refused(429, message, REJECTED_FULL, RETRY_AFTER) from None
        self._held_changed(service)
        if service.poller is None or service.poller.done():
            service.poller = asyncio.create_task(self._poll(service))
        try:
            remaining = self.hold_timeout - (time.monotonic() - arrived)
            return await asyncio.wait_for(future, remaining)
        except TimeoutError:
            message = f"No replica became ready within {self.hold_timeout:g} s"
            raise Refused(503, message, TIMED_OUT) from None
        finally:
            service.queue.drop(future)
            self._held_changed(service)

    async def _forward(self, request: web.BaseRequest, body: bytes, backend: str):
        """Pass the request on and stream the answer back as it arrives (SSE chunk by
        chunk). The status and headers are the backend's, hop-by-hop ones aside."""
        assert self._session is not None
        url = yarl.URL(backend + request.raw_path, encoded=True)
        headers = end_to_end(request.headers, "host", "content-length")
        response = web.StreamResponse()
        try:
            async with self._session.request(
                request.method, url, data=body or None, headers=headers, allow_redirects=False
            ) as upstream:
                response.set_status(upstream.status, upstream.reason)
                response.headers.update(end_to_end(upstream.headers))
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
        except aiohttp.ClientError as e:
            if response.prepared:
                raise  # the status is sent: dropping the connection is all that is left
            logger.warning("%s %s: %s", backend, request.path, e)
            return error_response(502, f"The replica did not answer: {type(e).__name__}")
        await response.write_eof()
        return response

    # ------------------------------------------------------------------ the service

    async def _poll(self, service: Service) -> None:
        """While any request of the service is held: ask for a replica (again every wake
        interval) and look for a Ready one."""
        while service.queue:
            if time.monotonic() - service.woken_at >= self.wake_interval:
                service.woken_at = time.monotonic()
                await self._wake(service)
            await self._refresh(service)
            if service.queue:
                await asyncio.sleep(self.poll_interval)

    async def _wake(self, service: Service) -> None:
        try:
            await call(self.wake, service.namespace, service.name)
        except Exception as e:  # the next wake interval tries again
            logger.warning("waking %s/%s: %r", service.namespace, service.name, e)

    async def _refresh(self, service: Service) -> list[str]:
        """The service's Ready backends, asked at most once per poll interval (concurrent
        callers share the answer); any held requests go to them, in arrival order."""
        async with service.refreshing:
            if time.monotonic() - service.checked_at >= self.poll_interval:
                try:
                    backends = await call(self.endpoints, service.namespace, service.name)
                    service.backends = list(backends)
                except Exception as e:  # hold rather than guess; the next poll asks again
                    logger.warning("endpoints of %s/%s: %r", service.namespace, service.name, e)
                    service.backends = []
                service.checked_at = time.monotonic()
        if service.backends and service.queue:
            service.queue.release(service.next_backend)
        return service.backends

    def _held_changed(self, service: Service) -> None:
        self.metrics.held.labels(service.namespace, service.name).set(len(service.queue))

    def _count(self, service: Service | None, outcome: str) -> None:
        namespace, name = (service.namespace, service.name) if service else ("", "")
        self.metrics.requests.labels(namespace, name, outcome).inc()
