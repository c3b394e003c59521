"""The activator's listening socket with a connection limit. aiohttp's Application runner
has no such bound, so the activator uses its low-level Server (public API), whose protocol
factory refuses a connection past the limit with a 503 before reading a byte of it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from aiohttp import web

_BODY = json.dumps({"error": {"message": "Too many connections", "code": 503, "param": None,
                               "type": "ServiceUnavailableError"}}).encode()  # fmt: skip
OVERLOADED = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


class Overloaded(asyncio.Protocol):
    """A connection past the limit: a 503 and the connection closed, nothing read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(OVERLOADED)  # type: ignore[attr-defined]
        transport.close()


class LimitedServer(web.Server):
    """aiohttp's Server that hands out at most ``max_connections`` request handlers."""

    def __init__(self, handler, *, max_connections: int, **kwargs):
        super().__init__(handler, **kwargs)
        self.max_connections = max_connections

    def __call__(self):
        if len(self.connections) >= self.max_connections:
            return Overloaded()
        return super().__call__()


class Runner(web.ServerRunner):
    """ServerRunner that also runs ``on_cleanup`` (the activator's own resources)."""

    def __init__(self, server: web.Server, on_cleanup: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(server, **kwargs)
        self._on_cleanup = on_cleanup

    async def cleanup(self) -> None:
        await super().cleanup()
        await self._on_cleanup()
