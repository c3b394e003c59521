"""Bearer-token checks: --api-key on the public port and the admin token on the admin port.

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


# What the kubelet and Prometheus reach without credentials: nothing they answer reveals
# a prompt or runs the model.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class ApiKeyMiddleware:
    """401 without `Authorization: Bearer <api key>` on every route but the probes and
    /metrics: /v1/*, /tokenize, /detokenize, /version and the OpenAPI schema alike, since
    tokenizing is work that an unauthenticated client should not be able to ask for."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if (
            self.api_key
            and scope["type"] == "http"
            and scope["path"] not in OPEN_PATHS
            and scope["method"] != "OPTIONS"
            and not token_matches(bearer_token(scope["headers"]), self.api_key)
        ):
            return await send_error(send, 401, "Invalid or missing API key",
                                    {"www-authenticate": "Bearer"})  # fmt: skip
        return await self.app(scope, receive, send)
