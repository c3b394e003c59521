"""The activator's hold queue and its edges, over real HTTP on 127.0.0.1: small aiohttp apps
play the replicas, the activator runs as in production (`Activator.start`), and only the
Kubernetes callables (resolve, wake, endpoints) are the test's own.

Bounds (429 with Retry-After), the hold timeout (503), FIFO release, a client leaving while
held or while forwarded, 404 and 413, and the Host header's forms."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from batchpilot.operator.activator.hold_queue import HoldQueue, QueueFull
from batchpilot.operator.activator.hosts import parse_host
from batchpilot.operator.activator.proxy import Activator
from tests.support.wait import eventually

HOST = "chat.team-a"
TARGET = ("team-a", "chat")
LABELS = {"namespace": "team-a", "service": "chat"}
TIMEOUT = 30.0  # for requests: the machine is shared


@contextlib.asynccontextmanager
async def replica(app: web.Application):
    """A stand-in replica on a free port: its base URL. Its handlers are cancelled when
    their client goes away, as the server's are."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class Kube:
    """The callables: the test says which backends are Ready; wake calls are recorded."""

    def __init__(self, backends: list[str] | None = None):
        self.backends = backends or []
        self.wakes: list[tuple[str, str]] = []
        self.resolved: list[str] = []

    def resolve(self, host: str, client_ip: str):
        """As KubeTargets: only the routed service (TARGET), by any of its names."""
        self.resolved.append(host)
        assert client_ip == "127.0.0.1"
        if host == "flaky":
            raise RuntimeError("API server unreachable")
        named = parse_host(host) or (TARGET if host in ("chat", "10.96.0.5", "fd00::5") else None)
        return named if named == TARGET else None

    async def wake(self, namespace: str, name: str) -> None:
        self.wakes.append((namespace, name))

    def endpoints(self, namespace: str, name: str) -> list[str]:
        assert (namespace, name) == TARGET
        return self.backends


@contextlib.asynccontextmanager
async def activator(kube: Kube, **options):
    """The activator on a free port, and a client session that sends Host: chat.team-a."""
    options.setdefault("poll_interval", 0.05)
    act = Activator(kube.resolve, kube.wake, kube.endpoints, **options)
    runner = await act.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession(url, headers={"Host": HOST}) as session:
            yield act, session
    finally:
        await runner.cleanup()


def held(act: Activator) -> float:
    return act.metrics.registry.get_sample_value("batchpilot_activator_held_requests", LABELS)


def count(act: Activator, outcome: str, labels: dict = LABELS) -> float:
    sample = {**labels, "outcome": outcome}
    return act.metrics.registry.get_sample_value("batchpilot_activator_requests_total", sample)


def echo_replica(name: str = "replica") -> web.Application:
    """Answers any /v1 path with what it received, status 201 and a header of its own."""

    async def echo(request: web.Request) -> web.Response:
        body = {"replica": name, "method": request.method, "path_qs": request.raw_path,
                "headers": dict(request.headers), "body": (await request.read()).decode()}  # fmt: skip
        return web.json_response(body, status=201, headers={"X-Replica": name})

    app = web.Application()
    app.router.add_route("*", "/v1/{path:.*}", echo)
    return app


async def get_json(session: aiohttp.ClientSession, path: str = "/v1/models", **kwargs):
    async with session.get(path, **kwargs) as resp:
        return resp.status, resp.headers, await resp.json()


def assert_openai_error(body: dict, status: int, error_type: str) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (
        error_type,
        None,
        status,
    )
    assert body["error"]["message"]


def test_the_activator_needs_only_the_operator_images_dependencies():
    code = (
        "import sys\n"
        "import batchpilot.operator.activator.proxy, batchpilot.operator.activator.kube\n"
        "from batchpilot.cli import build_parser\n"
        "args = build_parser(['activator']).parse_args(['activator', '--hold-timeout-seconds',"
        " '9'])\n"
        "assert args.hold_timeout_seconds == 9.0\n"
        "heavy = ('torch', 'transformers', 'triton', 'fastapi', 'starlette', 'httpx', 'uvicorn')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- the Host header


@pytest.mark.parametrize(
    ("host", "target"),
    [
        ("chat.team-a", TARGET),
        ("chat.team-a:8000", TARGET),
        ("chat.team-a.svc", TARGET),
        ("chat.team-a.svc:80", TARGET),
        ("chat.team-a.svc.cluster.local", TARGET),
        ("Chat.Team-A.svc.cluster.local.:8000", TARGET),
        ("chat.team-a.svc.other.domain", None),  # not this cluster's domain
        ("chat.team-a.example.com", None),
        ("chat", None),  # a bare name: the resolver's
        ("chat:8000", None),
        ("10.96.0.5", None),  # an IP: the resolver's
        ("10.96.0.5:8000", None),
        ("[fd00::5]:8000", None),
        ("-chat.team-a", None),  # not DNS labels
        ("chat_1.team-a", None),
        ("", None),
        ("[fd00::5", None),
    ],
)
def test_host_header_forms(host, target):
    assert parse_host(host, "cluster.local") == target


def test_every_host_goes_to_the_resolver_and_those_it_refuses_get_404_and_no_state():
    kube = Kube()

    async def main():
        async with replica(echo_replica()) as url, activator(kube) as (act, session):
            kube.backends = [url]
            for host in ("chat:8000", "10.96.0.5:8000", "[fd00::5]:80", "chat.team-a.svc"):
                status, _, body = await get_json(session, headers={"Host": host})
                assert (status, body["replica"]) == (201, "replica"), host
            for host in ("nope", "10.0.0.1", "a.b.example.com", "chat.team-b", "x.team-a"):
                status, _, body = await get_json(session, headers={"Host": host})
                assert status == 404, host
                assert_openai_error(body, 404, "NotFoundError")
            assert list(act.services) == [TARGET]  # nothing kept for the refused hosts
            status, _, body = await get_json(session, "/admin/config")
            assert status == 404
            status, _, body = await get_json(session, headers={"Host": "flaky"})
            assert status == 503  # a lookup that failed may succeed on a retry
            assert_openai_error(body, 503, "ServiceUnavailableError")
            assert count(act, "not_found", {"namespace": "", "service": ""}) == 6
            assert count(act, "forwarded") == 4
            assert series_services(act) == {("", ""), TARGET}

    asyncio.run(main())
    assert kube.resolved == ["chat", "10.96.0.5", "fd00::5", "chat.team-a.svc", "nope",
                             "10.0.0.1", "a.b.example.com", "chat.team-b", "x.team-a", "flaky"]  # fmt: skip


def series_services(act: Activator) -> set[tuple[str, str]]:
    """The (namespace, service) label pairs of every series the activator exports."""
    return {(s.labels["namespace"], s.labels["service"])
            for metric in act.metrics.registry.collect() for s in metric.samples
            if "namespace" in s.labels}  # fmt: skip


# --------------------------------------------------------------------------- the queue


def test_release_is_first_in_first_out_round_robin_and_skips_those_that_left():
    async def main():
        queue = HoldQueue(limit=4)
        futures = [queue.hold() for _ in range(4)]
        with pytest.raises(QueueFull):
            queue.hold()
        futures[1].cancel()  # its client left: wait_for cancels the future
        queue.drop(futures[1])
        assert len(queue) == 3
        order = []
        for i, f in enumerate(futures):
            f.add_done_callback(lambda _, i=i: order.append(i))
        backends = iter(["a", "b", "a", "b"])
        assert queue.release(lambda: next(backends)) == 3
        await asyncio.sleep(0)  # done callbacks run on the next loop turn
        assert len(queue) == 0
        assert [f.result() for f in futures if not f.cancelled()] == ["a", "b", "a"]
        assert order == [1, 0, 2, 3]  # 1 was cancelled first; the rest in arrival order

    asyncio.run(main())


def test_a_full_queue_answers_429_with_retry_after():
    async def main():
        kube = Kube()
        async with activator(kube, max_held_per_service=2) as (act, session):
            waiting = [asyncio.create_task(get_json(session)) for _ in range(2)]
            await eventually("2 held requests", lambda: held(act) == 2)
            status, headers, body = await get_json(session)
            assert status == 429
            assert int(headers["Retry-After"]) > 0
            assert_openai_error(body, 429, "RateLimitError")
            assert count(act, "rejected_full") == 1
            assert kube.wakes[0] == TARGET
            async with replica(echo_replica()) as url:
                kube.backends = [url]
                results = await asyncio.wait_for(asyncio.gather(*waiting), TIMEOUT)
            assert [status for status, _, _ in results] == [201, 201]
            assert held(act) == 0

    asyncio.run(main())


def test_held_bodies_are_bounded_in_bytes_over_every_service():
    async def main():
        kube = Kube()
        async with activator(kube, max_held_bytes=1000) as (act, session):
            first = asyncio.create_task(session.post("/v1/completions", data=b"x" * 600))
            await eventually("1 held request", lambda: held(act) == 1)
            # 600 held: another 600 would pass the bound, whatever the service.
            async with session.post("/v1/completions", data=b"y" * 600) as resp:
                assert resp.status == 429 and int(resp.headers["Retry-After"]) > 0
                assert_openai_error(await resp.json(), 429, "RateLimitError")
            assert act.held_bytes == 600
            async with replica(echo_replica()) as url:
                kube.backends = [url]
                async with await asyncio.wait_for(first, TIMEOUT) as resp:
                    assert resp.status == 201
            assert act.held_bytes == 0

    asyncio.run(main())


def test_a_request_held_past_the_timeout_gets_503():
    async def main():
        kube = Kube()
        async with activator(kube, hold_timeout=0.5) as (act, session):
            started = time.monotonic()
            status, _, body = await get_json(session)
            assert status == 503 and time.monotonic() - started >= 0.5
            assert_openai_error(body, 503, "ServiceUnavailableError")
            assert count(act, "timed_out") == 1 and held(act) == 0

    asyncio.run(main())


def test_a_client_that_leaves_while_held_frees_its_place():
    async def main():
        kube = Kube()
        async with activator(kube, max_held_per_service=1) as (act, session):
            leaver = asyncio.create_task(get_json(session))
            await eventually("1 held request", lambda: held(act) == 1)
            leaver.cancel()  # closes its connection
            await eventually("no held request", lambda: held(act) == 0)
            await eventually(
                "1 request counted as disconnected", lambda: count(act, "disconnected") == 1
            )
            stayer = asyncio.create_task(get_json(session, "/v1/models?x=1"))
            await eventually(
                "1 held request", lambda: held(act) == 1
            )  # the place is free: held, not 429
            async with replica(echo_replica()) as url:
                kube.backends = [url]
                status, _, body = await asyncio.wait_for(stayer, TIMEOUT)
            assert (status, body["path_qs"]) == (201, "/v1/models?x=1")
            assert count(act, "rejected_full") is None

    asyncio.run(main())


def test_wake_is_asked_again_while_requests_stay_held():
    async def main():
        kube = Kube()
        async with activator(kube, wake_interval=0.1) as (_, session):
            task = asyncio.create_task(get_json(session))
            await eventually("3 wake calls", lambda: len(kube.wakes) >= 3)
            async with replica(echo_replica()) as url:
                kube.backends = [url]
                assert (await asyncio.wait_for(task, TIMEOUT))[0] == 201

    asyncio.run(main())


def test_requests_stay_held_while_wake_and_endpoints_fail():
    class Failing(Kube):
        failures = 3

        async def wake(self, namespace: str, name: str) -> None:
            await super().wake(namespace, name)
            raise RuntimeError("API server unreachable")

        def endpoints(self, namespace: str, name: str) -> list[str]:
            self.failures -= 1
            if self.failures >= 0:
                raise RuntimeError("API server unreachable")
            return super().endpoints(namespace, name)

    async def main():
        async with replica(echo_replica()) as url:
            kube = Failing([url])
            async with activator(kube, wake_interval=0.05) as (act, session):
                status, _, _ = await asyncio.wait_for(get_json(session), TIMEOUT)
                assert status == 201 and kube.failures < 0 and kube.wakes
                assert count(act, "forwarded") == 1

    asyncio.run(main())


def test_a_body_over_the_bound_gets_413():
    async def main():
        async with (
            replica(echo_replica()) as url,
            activator(Kube([url]), max_body_bytes=1000) as (act, session),
        ):
            async with session.post("/v1/completions", data=b"x" * 1001) as resp:
                assert resp.status == 413
                assert_openai_error(await resp.json(), 413, "RequestTooLargeError")
            async with session.post("/v1/completions", data=b"x" * 1000) as resp:
                assert resp.status == 201
            assert count(act, "too_large") == 1

    asyncio.run(main())


# --------------------------------------------------------------------------- forwarding


def test_forwarding_passes_method_path_body_and_end_to_end_headers_round_robin():
    async def main():
        async with (
            replica(echo_replica("r0")) as r0,
            replica(echo_replica("r1")) as r1,
            activator(Kube([r0, r1])) as (_, session),
        ):
            answers = []
            for _ in range(4):
                async with session.post(
                    "/v1/chat/completions?a=1&b=x%20y",
                    data=b'{"k": 1}',
                    headers={"Authorization": "Bearer sk-1", "Connection": "keep-alive, X-Hop",
                             "X-Hop": "no", "X-End": "yes", "Content-Type": "application/json"},
                ) as resp:  # fmt: skip
                    assert resp.status == 201 and resp.headers["X-Replica"] in ("r0", "r1")
                    answers.append(await resp.json())
        assert [a["replica"] for a in answers] == ["r0", "r1", "r0", "r1"]
        first = answers[0]
        assert (first["method"], first["path_qs"], first["body"]) == (
            "POST",
            "/v1/chat/completions?a=1&b=x%20y",
            '{"k": 1}',
        )
        assert first["headers"]["Authorization"] == "Bearer sk-1"
        assert first["headers"]["X-End"] == "yes"
        assert "X-Hop" not in first["headers"]

    asyncio.run(main())


def test_streams_pass_chunk_by_chunk_and_a_client_leaving_aborts_the_upstream_request():
    """The replica's stream never ends: the client reads its first event all the same (no
    buffering), then leaves, and the replica sees its own client, the activator, go."""

    async def main():
        gone = asyncio.Event()

        async def endless(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            try:
                while True:
                    await response.write(b"data: tick\n\n")
                    await asyncio.sleep(0.02)
            except (asyncio.CancelledError, ConnectionResetError):
                gone.set()
                raise

        app = web.Application()
        app.router.add_post("/v1/completions", endless)
        async with replica(app) as url, activator(Kube([url])) as (_, session):
            async with session.post("/v1/completions", data=b"{}") as resp:
                assert resp.status == 200
                assert (await resp.content.readuntil(b"\n\n")) == b"data: tick\n\n"
                resp.close()  # the client goes away mid-stream
            await asyncio.wait_for(gone.wait(), TIMEOUT)

    asyncio.run(main())


# --------------------------------------------------------------------------- the bounds


async def raw_exchange(port: int, data: bytes, wait: float = TIMEOUT) -> bytes:
    """Send raw bytes, then read what comes back until the activator closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), wait)
    finally:
        writer.close()


def port_of(session: aiohttp.ClientSession) -> int:
    return session._base_url.port  # the activator fixture's


def test_a_body_slower_than_the_read_timeout_gets_408_and_frees_its_bytes():
    async def main():
        async with activator(Kube(), body_read_timeout=0.5) as (act, session):
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: chat.team-a\r\n"
                    b"Content-Length: 100\r\n\r\n" + b"x" * 10)  # fmt: skip
            started = time.monotonic()
            answer = await raw_exchange(port_of(session), head)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
            assert time.monotonic() - started < TIMEOUT / 2
            assert act.held_bytes == 0 and not held(act)

    asyncio.run(main())


def test_past_the_connection_limit_a_new_connection_gets_503_at_once():
    async def main():
        async with activator(Kube(), max_connections=2) as (_, session):
            port = port_of(session)
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            answer = await raw_exchange(
                port, b"GET /v1/models HTTP/1.1\r\nHost: chat.team-a\r\n\r\n"
            )
            assert answer.startswith(b"HTTP/1.1 503"), answer[:80]
            assert b"Too many connections" in answer
            for _, writer in idle:
                writer.close()
            # Once they are gone, a connection is served again (the server notices the
            # close on its next loop turns).
            deadline = time.monotonic() + TIMEOUT
            while (status := (await get_json(session, headers={"Host": "nope"}))[0]) == 503:
                assert time.monotonic() < deadline, "connections never freed"
                await asyncio.sleep(0.05)
            assert status == 404

    asyncio.run(main())


def test_an_absolute_form_target_gets_400_and_is_not_forwarded():
    async def main():
        kube = Kube()
        async with activator(kube) as (act, session):
            request = b"GET http://chat.team-a/v1/models HTTP/1.1\r\nHost: chat.team-a\r\n\r\n"
            answer = await raw_exchange(port_of(session), request)
            assert answer.startswith(b"HTTP/1.1 400"), answer[:80]
            assert not count(act, "forwarded") and kube.wakes == []

    asyncio.run(main())


def test_a_forwarded_body_stays_counted_until_its_answer_is_done():
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await release.wait()
        return web.json_response({}, status=200)

    slow_replica = web.Application()
    slow_replica.router.add_post("/v1/completions", slow)

    async def main():
        kube = Kube()
        async with replica(slow_replica) as url, activator(kube) as (act, session):
            kube.backends = [url]
            sent = asyncio.create_task(session.post("/v1/completions", data=b"z" * 700))
            await eventually("the body forwarded", lambda: count(act, "forwarded") == 1)
            assert act.held_bytes == 700  # in memory until the answer is done
            release.set()
            async with await asyncio.wait_for(sent, TIMEOUT) as resp:
                assert resp.status == 200
            await eventually("the bytes freed", lambda: act.held_bytes == 0)

    asyncio.run(main())


def test_a_forgotten_service_leaves_no_series():
    act = Activator(Kube().resolve, Kube().wake, Kube().endpoints)
    act.metrics.requests.labels(*TARGET, "forwarded").inc()
    act.metrics.held.labels(*TARGET).set(0)
    act.metrics.forget(*TARGET)
    assert series_services(act) == set()


def test_readyz_answers_503_until_the_activator_can_resolve():
    synced = []

    async def main():
        act_options = {"ready": lambda: bool(synced)}
        async with activator(Kube(), **act_options) as (_, session):
            async with session.get("/readyz") as resp:
                assert resp.status == 503
            synced.append(True)
            async with session.get("/readyz") as resp:
                assert resp.status == 200
            async with session.get("/healthz") as resp:
                assert resp.status == 200  # liveness does not depend on the API server

    asyncio.run(main())


def test_an_oversized_header_gets_400_before_any_lookup():
    async def main():
        kube = Kube()
        async with activator(kube) as (_, session):
            flood = b"X-Big: " + b"a" * 64_000 + b"\r\n"
            request = b"GET /v1/models HTTP/1.1\r\nHost: chat.team-a\r\n" + flood + b"\r\n"
            answer = await raw_exchange(port_of(session), request)
            assert answer.split(b" ", 2)[1] == b"400", answer[:80]  # aiohttp's own, HTTP/1.0
            assert kube.resolved == []

    asyncio.run(main())
