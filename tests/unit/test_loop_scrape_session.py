"""scrape.py's ScrapeSession: a source's turns reuse their replicas' connections
(keep-alive) instead of a session and a connection per replica per turn."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from batchpilot.operator.loop.scrape import UrlMetricsSource
from tests.support.loop import FakeServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve_and_scrape(turns: int, each_loop_fresh: bool = False) -> tuple[set, list]:
    peers: set = set()
    text = FakeServer().text()

    async def metrics(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername"))
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    ports = [free_port(), free_port()]
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    source = UrlMetricsSource([f"http://127.0.0.1:{p}" for p in ports])
    answers = []
    try:
        for _ in range(turns):
            answers.append(await source.scrape("ns", "svc"))
    finally:
        await source.session.get().close()
        await runner.cleanup()
    return peers, answers


def test_turns_reuse_their_replicas_connections():
    peers, answers = asyncio.run(serve_and_scrape(turns=4))
    assert all(s.text is not None and s.error is None for a in answers for s in a), answers
    assert len(peers) == 2  # one connection per replica for all four turns, not eight


def test_a_new_event_loop_gets_a_session_of_its_own():
    source = UrlMetricsSource(["http://127.0.0.1:9"])

    async def session():
        return source.session.get()

    first = asyncio.run(session())
    second = asyncio.run(session())
    assert first is not second and first.closed and not second.closed
    asyncio.run(second.close())
