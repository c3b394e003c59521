"""Faults injected into a live `batchpilot serve` (tests/integration/fault_hooks): a fault
in one sequence's sampling fails only its request, with a 500 in OpenAI's shape (an SSE
error event when streamed), while the requests batched with it finish exactly as they
would have; a failed forward fails only its step's batch; and only repeated consecutive
failed steps end the engine, after which /health answers 503."""

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from batchpilot import names
from tests.support.servers import TINY_FLAGS, ServerProcess
from tests.support.wait import wait_for

HOOKS = Path(__file__).resolve().parent / "fault_hooks"
POISON_SEED, POISON_TOKEN, LATCH_TOKEN = 424242, 4242, 4243  # fault_hooks/sitecustomize.py
MODEL = "tiny"
MAX_MODEL_LEN = 1024
LONG = 1000  # tokens: the batch-mates run long enough to share steps with the poisoned one


def start_server(tmp_path_factory) -> ServerProcess:
    from tests.support.models import make_tiny_llama

    tiny = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    args = ["--model", tiny, "--served-model-name", MODEL, *TINY_FLAGS, "--max-num-seqs", "8",
            "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("faults") / "serve.log")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(HOOKS))  # the server imports the hooks at start-up
        return proc.start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server(tmp_path_factory)
    yield proc
    proc.stop()


def greedy(server, prompt: str, **fields):
    return server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=LONG,
                                              temperature=0, extra_body={"ignore_eos": True},
                                              **fields)  # fmt: skip


def start_all(server, prompts: list[str], finished: dict) -> list[threading.Thread]:
    """One long greedy request per prompt, concurrently: finished[prompt] = (text, when)."""

    def run(prompt):
        out = greedy(server, prompt)
        finished[prompt] = (out.choices[0].text, time.monotonic())

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    return threads


def sse_events(response: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


def test_a_sampling_fault_fails_only_its_request_and_its_batch_mates_finish(server):
    prompts = ["one two three", "the weather today", "once upon a time"]
    finished: dict[str, tuple[str, float]] = {}
    mates = start_all(server, prompts, finished)
    wait_for(
        "len(prompts) running requests",
        lambda: server.metric(names.NUM_REQUESTS_RUNNING) == len(prompts),
        timeout=120,
        interval=0.05,
    )

    with pytest.raises(openai.InternalServerError) as failed:
        greedy(server, "poisoned", seed=POISON_SEED)
    failed_at = time.monotonic()
    error = failed.value.body
    assert error["code"] == 500 and error["type"] == "InternalServerError", error
    with server.http() as http, http.stream("POST", "/v1/completions", json={
        "prompt": "poisoned too", "max_tokens": 4, "seed": POISON_SEED, "stream": True,
    }) as streamed:  # fmt: skip
        assert streamed.status_code == 200  # the header went out before the first step
        assert sse_events(streamed)[-1]["error"]["code"] == 500

    for thread in mates:
        thread.join(300)
    assert set(finished) == set(prompts)
    assert all(at > failed_at for _, at in finished.values()), "no mate was in its batch"
    # Each mate's text is what the same requests give without the poisoned one.
    again: dict[str, tuple[str, float]] = {}
    for thread in start_all(server, prompts, again):
        thread.join(300)
    assert {p: text for p, (text, _) in again.items()} == {p: t for p, (t, _) in finished.items()}
    assert server.metric(names.KV_CACHE_USAGE) == 0.0  # the failed request's blocks are free
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_a_forward_fault_fails_its_batch_and_the_next_step_serves(server):
    with pytest.raises(openai.InternalServerError):
        server.client().completions.create(model=MODEL, prompt=[1, POISON_TOKEN], max_tokens=4)
    out = server.client().completions.create(model=MODEL, prompt="still here", max_tokens=4)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_repeated_consecutive_step_failures_end_the_engine_and_health_turns_503(
    tmp_path_factory,
):
    server = start_server(tmp_path_factory)
    try:
        client = server.client()
        # From this step on every forward raises, as after a device-side assert.
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt=[1, LATCH_TOKEN], max_tokens=4)
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # one failure
        statuses = []
        for _ in range(2):
            with server.http() as http:
                statuses.append(http.post("/v1/completions", json={"prompt": "hi"}).status_code)
        # The second failure in a row fails its request; the third ends the engine, and
        # its request with it (500 or 503, depending on where the end finds it).
        assert statuses[0] == 500 and statuses[1] in (500, 503)
        wait_for(
            "/health to answer 503",
            lambda: httpx.get(f"{server.url}/health", timeout=30).status_code == 503,
            interval=0.05,
        )
        body = httpx.get(f"{server.url}/health", timeout=30).json()
        assert body["error"]["code"] == 503
    finally:
        server.stop()
