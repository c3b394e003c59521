"""The activator in front of a real `batchpilot serve` (the tiny random Llama) on 127.0.0.1,
driven by the openai client with `Host: chat.team-a`: requests held while the service has no
Ready replica come back, once it has one, exactly as the server answers them directly,
streams chunk by chunk; the bound (429), the hold timeout (503), and no hold at all while a
replica is Ready. Only the Kubernetes callables are the test's: `endpoints` names the
server once the test says the replica is Ready."""

from __future__ import annotations

import asyncio

import openai
import pytest

from batchpilot.operator.activator.proxy import Activator
from tests.support.servers import TINY_FLAGS, ServerProcess
from tests.support.wait import eventually

MODEL = "tiny"
HOST = "chat.team-a"
LABELS = {"namespace": "team-a", "service": "chat"}
TIMEOUT = 120.0  # for conditions and requests: the machine is shared
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support.models import make_tiny_llama

    tiny = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    args = ["--model", tiny, "--served-model-name", MODEL, *TINY_FLAGS, "--max-num-seqs", "16"]
    proc = ServerProcess(args, tmp_path_factory.mktemp("activator") / "serve.log").start()
    yield proc
    proc.stop()


class Replicas:
    """The Kubernetes side: the server is Ready once ``ready`` is set; wakes are recorded."""

    def __init__(self, url: str, ready: bool):
        self.url, self.ready = url, ready
        self.wakes: list[tuple[str, str]] = []

    def resolve(self, host: str, client_ip: str) -> tuple[str, str] | None:
        """The routed service: the tests always name it in full."""
        return ("team-a", "chat") if host == HOST else None

    def wake(self, namespace: str, name: str) -> None:
        self.wakes.append((namespace, name))

    def endpoints(self, namespace: str, name: str) -> list[str]:
        assert (namespace, name) == ("team-a", "chat")
        return [self.url] if self.ready else []


def sample(act: Activator, name: str, **labels: str) -> float:
    return act.metrics.registry.get_sample_value(name, labels) or 0.0


def held(act: Activator) -> float:
    return sample(act, "batchpilot_activator_held_requests", **LABELS)


async def run_activator(replicas: Replicas, scenario, **options) -> None:
    """``scenario(activator, client)`` with the activator on a free port and an openai
    client that reaches it with `Host: chat.team-a`."""
    act = Activator(replicas.resolve, replicas.wake, replicas.endpoints, **options)
    runner = await act.start("127.0.0.1", 0)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1",
        api_key="none",
        max_retries=0,
        timeout=TIMEOUT,
        default_headers={"Host": HOST},
    )
    try:
        await scenario(act, client)
    finally:
        await client.close()
        await runner.cleanup()


def completion(prompt: str, **extra) -> dict:
    return dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True}, **extra)  # fmt: skip


def chat(content: str, **extra) -> dict:
    return dict(model=MODEL, messages=[{"role": "user", "content": content}],
                max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
                **extra)  # fmt: skip


# (kind, request): six plain requests and two streamed ones.
REQUESTS = [
    ("completion", completion("The capital of France is")),
    ("completion", completion("Once upon a time")),
    ("completion", completion("1, 2, 3,")),
    ("completion", completion("A long time ago", stream=True)),
    ("chat", chat("Hello there")),
    ("chat", chat("What is two plus two?")),
    ("chat", chat("Tell me a story", stream=True)),
    ("chat", chat("Say something")),
]


async def send(client: openai.AsyncOpenAI, kind: str, request: dict) -> tuple[str, int]:
    """The text of the answer and how many chunks it came in (1 unstreamed)."""
    create = client.completions.create if kind == "completion" else client.chat.completions.create
    answer = await create(**request)
    if not request.get("stream"):
        choice = answer.choices[0]
        return (choice.text if kind == "completion" else choice.message.content), 1
    texts = []
    async for chunk in answer:
        if chunk.choices:
            delta = chunk.choices[0]
            texts.append(delta.text if kind == "completion" else delta.delta.content or "")
    return "".join(texts), len(texts)


def test_held_requests_are_forwarded_once_a_replica_is_ready(server):
    replicas = Replicas(server.url, ready=False)
    results = {}

    async def direct():
        client = server.async_client(timeout=TIMEOUT)
        try:
            return await asyncio.gather(*(send(client, k, r) for k, r in REQUESTS))
        finally:
            await client.close()

    async def scenario(act: Activator, client: openai.AsyncOpenAI) -> None:
        sent = [asyncio.create_task(send(client, k, r)) for k, r in REQUESTS]
        await eventually("every request held", lambda: held(act) == len(REQUESTS))
        # The wake is the hold's own task: on a loaded machine it may come a moment after.
        await eventually("the service woken", lambda: bool(replicas.wakes))
        assert set(replicas.wakes) == {("team-a", "chat")}
        assert not any(task.done() for task in sent)
        replicas.ready = True
        results["via"] = await asyncio.wait_for(asyncio.gather(*sent), TIMEOUT)
        results["forwarded"] = sample(
            act, "batchpilot_activator_requests_total", **LABELS, outcome="forwarded"
        )
        assert held(act) == 0

    asyncio.run(run_activator(replicas, scenario))
    results["direct"] = asyncio.run(direct())
    assert results["forwarded"] == len(REQUESTS)
    for (kind, request), (via, chunks), (text, _) in zip(
        REQUESTS, results["via"], results["direct"], strict=True
    ):
        assert via == text and text, (kind, request)
        if request.get("stream"):
            assert chunks > 1, (kind, request)


def test_beyond_the_bound_a_request_gets_429_with_retry_after(server):
    replicas = Replicas(server.url, ready=False)

    async def scenario(act: Activator, client: openai.AsyncOpenAI) -> None:
        sent = [asyncio.create_task(send(client, *REQUESTS[i])) for i in range(2)]
        await eventually("2 held requests", lambda: held(act) == 2)
        with pytest.raises(openai.RateLimitError) as refused:
            await send(client, *REQUESTS[2])
        assert int(refused.value.response.headers["Retry-After"]) > 0
        error = refused.value.response.json()["error"]
        assert error == {"message": error["message"], "type": "RateLimitError", "param": None,
                         "code": 429}  # fmt: skip
        replicas.ready = True
        await asyncio.wait_for(asyncio.gather(*sent), TIMEOUT)

    asyncio.run(run_activator(replicas, scenario, max_held_per_service=2))


def test_a_request_held_past_the_timeout_gets_503(server):
    replicas = Replicas(server.url, ready=False)

    async def scenario(act: Activator, client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.InternalServerError) as refused:
            await send(client, *REQUESTS[0])
        assert refused.value.status_code == 503
        error = refused.value.response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("ServiceUnavailableError", None,
                                                                  503)  # fmt: skip
        assert held(act) == 0

    asyncio.run(run_activator(replicas, scenario, hold_timeout=1.0))


def test_with_a_ready_replica_a_request_is_forwarded_at_once(server):
    replicas = Replicas(server.url, ready=True)

    async def scenario(act: Activator, client: openai.AsyncOpenAI) -> None:
        text, _ = await send(client, *REQUESTS[0])
        assert text
        assert sample(act, "batchpilot_activator_hold_seconds_count") == 1
        assert sample(act, "batchpilot_activator_hold_seconds_bucket", le="0.1") == 1

    asyncio.run(run_activator(replicas, scenario))
    assert replicas.wakes == []
