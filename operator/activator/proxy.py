"""The activator: where the Service of an InferenceService scaled to zero sends its traffic.

It holds each request, asks for a replica (``wake``), waits until one is Ready
(``endpoints``) and then forwards the held requests to it in arrival order, streaming the
answers back. One activator serves every service; the Host header says which one a request
is for. The Kubernetes side (``resolve``, ``wake``, ``endpoints``) is passed in as plain
callables, sync or async: kube.py has the real ones, tests their own.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import re
import time
import urllib.parse
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

logger = logging.getLogger(__name__)

MAX_HELD_PER_SERVICE = 256
HOLD_TIMEOUT_SECONDS = 300.0
MAX_BODY_BYTES = 4 << 20  # the server's own bound (--max-request-body-bytes)
# The bodies held at once, over every service: the per-service count alone would let 256
# requests of 4 MiB each past a 512 MiB pod limit, and an OOM kill loses every held request.
MAX_HELD_BYTES = 128 << 20
# Services remembered at once: any Host of the <name>.<namespace> form makes an entry, so
# entries with nothing held are dropped past this, and a new one is refused (503) when all
# of them hold requests.
MAX_SERVICES = 1024
# While requests are held, `wake` is asked again this often (an annotation patch whose
# first attempt failed, or that the operator missed, gets another chance) ...
WAKE_INTERVAL_SECONDS = 5.0
# ... and `endpoints` at most this often: a held request is forwarded within this of its
# replica turning Ready.
POLL_INTERVAL_SECONDS = 0.5
# What a client refused for a full queue is told to wait: a cold start takes tens of
# seconds, so a retry sooner mostly finds the queue still full.
RETRY_AFTER_SECONDS = 5
CONNECT_TIMEOUT_SECONDS = 10.0
BODY_CHUNK_BYTES = 64 << 10

# Outcomes of batchpilot_activator_requests_total.
FORWARDED = "forwarded"
REJECTED_FULL = "rejected_full"
TIMED_OUT = "timed_out"
DISCONNECTED = "disconnected"
NOT_FOUND = "not_found"
TOO_LARGE = "too_large"

# RFC 9110's connection-specific headers: they describe one hop, never the next.
HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
     "trailer", "transfer-encoding", "upgrade"]
)  # fmt: skip
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# The types the server's errors carry (vLLM's names), for the statuses the activator sends.
ERROR_TYPES = {
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}

Target = tuple[str, str]  # (namespace, name)


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


def parse_host(host: str, cluster_domain: str = "cluster.local") -> Target | None:
    """(namespace, name) of a Service DNS name in a Host header: <name>.<namespace>,
    <name>.<namespace>.svc or <name>.<namespace>.svc.<cluster_domain>, any port. None for
    anything else, a bare name or an IP included (those need the resolver)."""
    hostname = host_name(host)
    if not hostname or is_ip(hostname):
        return None
    name, _, rest = hostname.partition(".")
    namespace, _, suffix = rest.partition(".")
    if suffix not in ("", "svc", f"svc.{cluster_domain}"):
        return None
    if not (DNS_LABEL.fullmatch(name) and DNS_LABEL.fullmatch(namespace)):
        return None
    return namespace, name


def host_name(host: str) -> str:
    """The Host header without its port or IPv6 brackets, lowercase, no trailing dot."""
    try:
        return (urllib.parse.urlsplit("//" + host).hostname or "").rstrip(".")
    except ValueError:  # an unbalanced IPv6 bracket
        return ""


def is_ip(hostname: str) -> bool:
    try:
        ipaddress.ip_address(hostname)
    except ValueError:
        return False
    return True


def end_to_end(headers: CIMultiDictProxy[str], *also_drop: str) -> CIMultiDict[str]:
    """The headers minus hop-by-hop ones (those a Connection header names included)."""
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",")}
    drop = HOP_BY_HOP | named | set(also_drop)
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


async def call(fn: Callable, *args):
    """Call a sync or an async callable alike."""
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed ``limit``."""
    too_large = Refused(413, f"The request body exceeds {limit} bytes", TOO_LARGE)
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.content.iter_chunked(BODY_CHUNK_BYTES):
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


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
            "disconnected, too_large, not_found (service labels empty: no service matched)",
            ["namespace", "service", "outcome"],
            registry=self.registry,
        )
        self.hold_seconds = Histogram(
            "batchpilot_activator_hold_seconds",
            "From a request's arrival to its forwarding",
            buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
            registry=self.registry,
        )


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
    """``resolve(host) -> (namespace, name) | None``: a bare service name or an IP (no
    port) -> its service. ``wake(namespace, name)``: ask for a replica.
    ``endpoints(namespace, name) -> list[str]``: base URLs of the Ready replicas, like
    http://10.244.0.7:8000. Each may be sync or async."""

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
        cluster_domain: str = "cluster.local",
        wake_interval: float = WAKE_INTERVAL_SECONDS,
        poll_interval: float = POLL_INTERVAL_SECONDS,
    ):
        self.resolve, self.wake, self.endpoints = resolve, wake, endpoints
        self.max_held_per_service = max_held_per_service
        self.hold_timeout = hold_timeout
        self.max_body_bytes = max_body_bytes
        self.max_held_bytes = max_held_bytes
        self.held_bytes = 0
        self.cluster_domain = cluster_domain
        self.wake_interval = wake_interval
        self.poll_interval = poll_interval
        self.metrics = ActivatorMetrics()
        self.services: dict[Target, Service] = {}
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{path:.*}", self._proxy)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close)
        return app

    async def start(self, host: str, port: int) -> web.AppRunner:
        """Serve on host:port (0: any free port, see the runner's ``addresses``)."""
        # A client that goes away cancels its handler: a held request leaves the queue,
        # a forwarded one closes its upstream connection (the server then aborts it).
        runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=5.0)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner

    async def _open_session(self, _: web.Application) -> None:
        # No cookie jar: one session serves every client. No decompression: bodies pass
        # through byte for byte, Content-Length and Content-Encoding stay true.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_SECONDS),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
        )

    async def _close(self, _: web.Application) -> None:
        for service in self.services.values():
            if service.poller:
                service.poller.cancel()
        if self._session:
            await self._session.close()

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({})

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ one request

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            self._count(None, NOT_FOUND)
            return error_response(404, f"Not found: {request.path}")
        if request.method not in ("GET", "POST"):
            return error_response(
                405, f"Method not allowed: {request.method}", {"Allow": "GET, POST"}
            )
        try:
            service = await self._service_of(request.host)
        except Refused as refused:
            self._count(None, refused.outcome)
            return refused.response()
        except Exception as e:  # the API server, most likely: a retry may well succeed
            logger.warning("resolving %r: %r", request.host, e)
            return error_response(503, f"Could not look up the service of {request.host!r}")
        if service is None:
            self._count(None, NOT_FOUND)
            return error_response(404, f"No InferenceService answers to the host {request.host!r}")
        arrived = time.monotonic()
        try:
            body = await read_body(request, self.max_body_bytes)
            backend = await self._backend_for(service, arrived, len(body))
        except Refused as refused:
            self._count(service, refused.outcome)
            return refused.response()
        except asyncio.CancelledError:
            self._count(service, DISCONNECTED)
            raise
        self._count(service, FORWARDED)
        self.metrics.hold_seconds.observe(time.monotonic() - arrived)
        return await self._forward(request, body, backend)

    async def _service_of(self, host: str) -> Service | None:
        target = parse_host(host, self.cluster_domain)
        hostname = host_name(host)
        if target is None and (is_ip(hostname) or DNS_LABEL.fullmatch(hostname)):
            target = await call(self.resolve, hostname)
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

    async def _backend_for(self, service: Service, arrived: float, size: int) -> str:
        """A Ready backend at once when there is one and nothing is held before this
        request; else hold it (its ``size`` bytes of body) until one is, or until the hold
        timeout."""
        if not service.queue and await self._refresh(service):
            return service.next_backend()
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        if self.held_bytes + size > self.max_held_bytes:
            message = f"{self.held_bytes} bytes of requests are already waiting for replicas"
            raise Refused(429, message, REJECTED_FULL, headers)
        try:
            future = service.queue.hold()
        except QueueFull:
            message = f"{service.queue.limit} requests are already waiting for a replica"
            raise Refused(429, message, REJECTED_FULL, headers) from None
        self.held_bytes += size
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
            self.held_bytes -= size
            self._held_changed(service)

    async def _forward(self, request: web.Request, body: bytes, backend: str):
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
