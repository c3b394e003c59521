"""Errors in OpenAI's JSON shape, as vLLM sends them:
{"error": {"message": ..., "type": ..., "param": ..., "code": <HTTP status>}}.

Every failure the API reports goes through `APIError` or one of the handlers here, so a
client always gets the same shape whatever went wrong.
"""

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# vLLM's type names, so clients and dashboards that match on them keep working.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# vLLM's type for the LoRA routes' own refusals (a missing field, a name loaded already).
INVALID_USER_INPUT = "InvalidUserInput"


class APIError(Exception):
    """error_type: where vLLM names the error otherwise than by its status (ERROR_TYPES)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None,
                 error_type: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.error_type = error_type


def error_body(status: int, message: str, param: str | None = None,
               error_type: str | None = None) -> dict:  # fmt: skip
    phrase = "".join(ch for ch in HTTPStatus(status).phrase.title() if ch.isalnum())
    error_type = error_type or ERROR_TYPES.get(status) or phrase + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None,
                   error_type: str | None = None) -> JSONResponse:  # fmt: skip
    body = error_body(status, message, param, error_type)
    return JSONResponse(body, status_code=status, headers=headers)


async def send_error(send, status: int, message: str, headers: dict[str, str] | None = None):
    """An error response from raw ASGI middleware, outside FastAPI."""
    body = json.dumps(error_body(status, message)).encode()
    raw_headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's error list -> one readable sentence and the offending parameter."""
    errors = exc.errors()
    if not errors:
        return "Invalid request", None
    first = errors[0]
    # loc is ("body", "field", ...): the field path is what a client can act on.
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"Malformed JSON in the request body: {first.get('msg')}", None
    message = first.get("msg", "Invalid value")
    if loc:
        message = f"{'.'.join(loc)}: {message}"
    # The top-level field is what OpenAI names as param; deeper parts (list positions, the
    # union member pydantic tried) stay in the message.
    param = loc[0] if loc else None
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers, exc.error_type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"Internal server error: {type(exc).__name__}")
