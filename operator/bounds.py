"""How much the operator takes from what tenants control: the byte limits on the answers it
reads from their replicas (/metrics, the admin API), and the one clip on the text it writes
into status and Events.

A replica is a tenant's pod: it may answer anything, of any size. One operator serves every
tenant, so an answer read whole, or an error text copied whole into an object, would let one
tenant take the operator (or the API server's objects) down for all of them.
"""

from __future__ import annotations

from typing import Any

# A replica's /metrics is about 13 KiB (server/api/metrics.py: its families, histograms
# included); 1 MiB is 80 times that, and keeps the parse, pure Python on the operator's
# event loop (~0.4 s per MiB), short.
METRICS_MAX_BYTES = 1 << 20
# Admin answers are small JSON: /admin/config under 1 KiB, /v1/models about 50 KiB at worst
# (32 adapters, each with a 1 KiB source path), an OpenAI error a line.
ADMIN_MAX_BYTES = 64 << 10
# Status fields, condition messages and Events: long enough for a few replicas' errors,
# short enough that no object grows with what a replica answers (kopf cuts Events at 1024).
MAX_MESSAGE_CHARS = 512


class AnswerTooLarge(ValueError):
    """A replica's answer went past its byte limit: it was not read further."""

    def __init__(self, limit: int):
        super().__init__(f"answer over {limit} bytes")
        self.limit = limit


async def read_limited(response: Any, limit: int) -> bytes:
    """An aiohttp response's body, or AnswerTooLarge as soon as it passes ``limit`` bytes:
    a declared Content-Length over it is refused unread, a stream is read one byte past it
    at most, and the connection is then closed rather than drained. The session's total
    timeout bounds the time (a replica that trickles bytes)."""
    if response.content_length is not None and response.content_length > limit:
        response.close()
        raise AnswerTooLarge(limit)
    body = bytearray()
    while chunk := await response.content.read(limit + 1 - len(body)):
        body += chunk
        if len(body) > limit:
            response.close()
            raise AnswerTooLarge(limit)
    return bytes(body)


def clip(text: str) -> str:
    """``text`` cut to MAX_MESSAGE_CHARS, with an ellipsis where it was cut: every message
    the operator writes into status or an Event goes through here."""
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[: MAX_MESSAGE_CHARS - 1] + "…"
