"""A server with one slot and a one-request queue: 429 with Retry-After when the queue is
full, and the admin API disabled when no admin token is configured."""

import threading

import httpx
import openai
import pytest

from batchpilot import names
from tests.support.servers import TINY_FLAGS, ServerProcess
from tests.support.wait import wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support.models import make_tiny_llama

    tiny = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    args = ["--model", tiny, "--served-model-name", "tiny", *TINY_FLAGS,
            "--max-num-seqs", "1", "--max-queue-len", "1",
            # Long enough that the running request cannot finish (and let the queued one
            # in) while the test checks the queue, however loaded the machine.
            "--max-model-len", "2048"]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("overload") / "serve.log").start()
    yield proc
    proc.stop()


def long_request(server, results: list) -> threading.Thread:
    def run():
        out = server.client().completions.create(
            model="tiny",
            prompt="go on",
            max_tokens=1500,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        results.append(out.choices[0].finish_reason)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_full_queue_answers_429_with_retry_after_and_loses_nothing(server):
    results: list = []
    running = long_request(server, results)
    wait_for(
        "1 running request", lambda: server.metric(names.NUM_REQUESTS_RUNNING) == 1, interval=0.05
    )
    queued = long_request(server, results)
    wait_for(
        "1 waiting request", lambda: server.metric(names.NUM_REQUESTS_WAITING) == 1, interval=0.05
    )

    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "me too", "max_tokens": 2})
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == 429 and "waiting" in r.json()["error"]["message"]
    with pytest.raises(openai.RateLimitError):
        server.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )

    running.join(600)
    queued.join(600)
    assert results == ["length", "length"]
    # With the queue drained, the same request is served.
    out = server.client().completions.create(model="tiny", prompt="me too", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_admin_api_is_absent_without_a_token(server):
    for method in ("GET", "PATCH"):
        r = httpx.request(method, f"{server.url}/admin/config", json={"max_num_seqs": 4},
                          headers={"Authorization": "Bearer anything"})  # fmt: skip
        assert r.status_code == 404
        assert r.json()["error"]["code"] == 404
    with pytest.raises(httpx.ConnectError):  # no admin listener at all
        httpx.get(f"{server.admin_url}/admin/config")
    assert server.metric(names.MAX_NUM_SEQS_METRIC) == 1
