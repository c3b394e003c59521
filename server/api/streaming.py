"""The SSE response of a streamed completion: it aborts its engine requests however it
ends, and gives up on a client that stops reading.

A client that never reads fills the socket buffers, after which every write waits. The
engine's outputs coalesce meanwhile (RequestStream), so memory stays bounded, but the
sequences would still hold KV blocks and batch slots that other requests need: past
--stream-stall-timeout seconds without progress on one write, the request is aborted and
the connection closed.
"""

import asyncio
import logging

from starlette.responses import StreamingResponse

from batchpilot.server.engine.client import RequestStream

logger = logging.getLogger(__name__)


class ClientStalled(Exception):
    pass


class AbortingStreamingResponse(StreamingResponse):
    def __init__(self, content, stream: RequestStream, stall_timeout: float):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._stream = stream
        self._stall_timeout = stall_timeout

    async def __call__(self, scope, receive, send):
        async def send_unless_stalled(message) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_timeout)
            except TimeoutError:
                raise ClientStalled from None

        try:
            await super().__call__(scope, receive, send_unless_stalled)
        except* ClientStalled:
            # Returning with the response incomplete makes uvicorn close the connection.
            logger.warning("aborting %s: the client read nothing for %.0f s",
                           ", ".join(self._stream.request_ids), self._stall_timeout)  # fmt: skip
        finally:
            self._stream.close()
