"""HeadLimitProtocol, uvicorn's httptools protocol with a bound on the request line and
headers, driven read by read over a fake transport: a head of the limit is served, one byte
more is refused with 431 and the connection closed, and bodies and earlier requests on the
connection are not counted against a head. The flood against a live server is in
tests/integration/test_server_hostile.py."""

import asyncio
import re

import uvicorn
from uvicorn.server import ServerState

from batchpilot.server.api.app import HeadLimitProtocol

LIMIT = 512


class Transport(asyncio.Transport):
    """What the protocol writes, and whether it closed the connection."""

    def __init__(self):
        super().__init__()
        self.written = b""
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5000)}.get(name)

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


async def app(scope, receive, send):
    """Answers with the length of the body it read."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    answer = b"%d" % size
    headers = [(b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def head(size: int, method: bytes = b"GET", body: bytes = b"") -> bytes:
    """A request whose line and headers are `size` bytes, then its body."""
    start = method + b" / HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\nX-Pad: " % len(body)
    pad = size - len(start) - len(b"\r\n\r\n")
    return start + b"a" * pad + b"\r\n\r\n" + body


def serve(*reads: bytes) -> Transport:
    """Feed the reads one by one, letting the app answer after each."""

    async def run() -> Transport:
        config = uvicorn.Config(app, http=HeadLimitProtocol, h11_max_incomplete_event_size=LIMIT,
                                log_config=None, lifespan="off")  # fmt: skip
        protocol = HeadLimitProtocol(config, ServerState(), {})
        transport = Transport()
        protocol.connection_made(transport)
        for data in reads:
            protocol.data_received(data)
            while protocol.tasks:
                await asyncio.gather(*protocol.tasks)
        return transport

    return asyncio.run(run())


def statuses(transport: Transport) -> list[bytes]:
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", transport.written)


def test_a_head_of_the_limit_is_served_and_one_byte_more_is_refused_with_431():
    assert statuses(serve(head(LIMIT))) == [b"200"]
    refused = serve(head(LIMIT + 1))
    assert statuses(refused) == [b"431"] and refused.closed
    assert refused.written.endswith(b"\r\n\r\nRequest Header Fields Too Large")


def test_the_limit_holds_over_many_reads_and_for_the_request_line():
    data = head(LIMIT + 1)
    assert statuses(serve(*(data[i : i + 7] for i in range(0, len(data), 7)))) == [b"431"]
    long_url = b"GET /" + b"a" * LIMIT + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    assert statuses(serve(long_url)) == [b"431"]


def test_a_body_in_the_same_read_is_not_counted_as_head():
    transport = serve(head(LIMIT - 8, b"POST", body=b"b" * (8 * LIMIT)))
    assert statuses(transport) == [b"200"] and transport.written.endswith(b"%d" % (8 * LIMIT))


def test_each_request_on_a_connection_has_its_own_limit():
    body = b"b" * LIMIT
    keep_alive = serve(head(LIMIT), head(LIMIT, b"POST", body), head(LIMIT))
    assert statuses(keep_alive) == [b"200"] * 3 and not keep_alive.closed
    pipelined = serve(head(LIMIT) + head(LIMIT, b"POST", body) + head(LIMIT))
    assert statuses(pipelined) == [b"200"] * 3
    # The second head is counted from its own start, in the read that ended the first.
    refused = serve(head(LIMIT) + head(LIMIT + 1))
    assert b"431" in statuses(refused) and refused.closed
