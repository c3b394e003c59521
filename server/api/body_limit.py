"""413 for request bodies over --max-request-body-bytes, before the app buffers them.

A raw ASGI middleware: it rejects on Content-Length up front and, for chunked bodies
without one, stops reading as soon as the bytes received pass the limit.
"""

from starlette.exceptions import HTTPException

from batchpilot.server.api.errors import send_error


def _message(max_bytes: int) -> str:
    return f"Request body too large: the limit is {max_bytes} bytes"


class BodyTooLarge(HTTPException):
    """Raised from receive(); FastAPI re-raises HTTPExceptions met while reading a body, so
    the app's error handler answers 413 in OpenAI's shape."""

    def __init__(self, max_bytes: int):
        super().__init__(413, _message(max_bytes))


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, 413, _message(self.max_bytes))

        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
