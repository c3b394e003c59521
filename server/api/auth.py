"""Bearer-token checks: --api-key on /v1/* (as vLLM does it) and the admin token.

Tokens are compared in constant time and never logged.
"""

import hmac

from batchpilot.server.api.errors import send_error


def bearer_token(headers) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, from ASGI raw headers or a
    Starlette Headers mapping."""
    if isinstance(headers, list):
        value = dict(headers).get(b"authorization", b"").decode("latin-1")
    else:
        value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def token_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


class ApiKeyMiddleware:
    """401 on /v1/* without `Authorization: Bearer <api key>`. Other paths (/health,
    /ready, /metrics, /admin with its own token) stay open, as in vLLM."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if (
            self.api_key
            and scope["type"] == "http"
            and scope["path"].startswith("/v1/")
            and scope["method"] != "OPTIONS"
            and not token_matches(bearer_token(scope["headers"]), self.api_key)
        ):
            return await send_error(send, 401, "Invalid or missing API key",
                                    {"www-authenticate": "Bearer"})  # fmt: skip
        return await self.app(scope, receive, send)
