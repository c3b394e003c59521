"""AdminClient.set_live against small HTTP replicas: a replica counts as done only when it
answers every changed knob back in force with the value sent."""

import asyncio
import socket

from aiohttp import web

from batchpilot.operator.loop.admin_client import PATH, AdminClient

TOKEN = "secret"


def replica(behaviour: str) -> web.Application:
    """ok: applies the PATCH; stale: answers 200 with max_num_seqs unchanged; refuse: 400."""
    config = {"max_num_seqs": 64, "max_num_batched_tokens": 512}

    async def patch(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        changes = await request.json()
        if behaviour == "refuse":
            return web.json_response({"error": {"message": "no"}}, status=400)
        if behaviour == "stale":
            changes.pop("max_num_seqs", None)
        config.update(changes)
        return web.json_response(config)

    app = web.Application()
    app.router.add_patch(PATH, patch)
    return app


async def set_live_on(behaviours: list[str], changes: dict) -> dict[str, str | None]:
    runners = [web.AppRunner(replica(b)) for b in behaviours]
    urls = []
    for runner in runners:
        await runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
    try:
        return await AdminClient(timeout=5).set_live(urls, TOKEN, changes)
    finally:
        for runner in runners:
            await runner.cleanup()


def test_set_live_reports_per_replica():
    changes = {"max_num_seqs": 16, "max_num_batched_tokens": 256}
    ok, stale, refused = asyncio.run(set_live_on(["ok", "stale", "refuse"], changes)).values()
    assert ok is None
    assert stale == "answered max_num_seqs=64"
    assert "HTTP 400" in refused


def test_set_live_of_one_knob_checks_only_that_one():
    results = asyncio.run(set_live_on(["ok", "stale"], {"max_num_batched_tokens": 128}))
    assert list(results.values()) == [None, None]


def test_an_unreachable_replica_is_a_failure_not_an_exception():
    results = asyncio.run(
        AdminClient(timeout=2).set_live(["http://127.0.0.1:9"], TOKEN, {"max_num_seqs": 4})
    )
    assert "http://127.0.0.1:9" in results["http://127.0.0.1:9"]
