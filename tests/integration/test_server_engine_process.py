"""`batchpilot serve --engine-process`: the engine in a process of its own answers exactly as
the engine thread does (text, logprobs, streams), /admin/config and the metrics cross the
pipe, a client that goes away frees its slot, and a dead engine process fails /health (503)
and every request (500, as a failed engine thread does) instead of hanging them."""

import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from batchpilot import names
from tests.support.servers import TINY_FLAGS, ServerProcess
from tests.support.wait import wait_for

ADMIN_TOKEN = "engine-process-admin-4410"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPTS = ["hello there", "The capital of", "1 2 3 4", "a much longer prompt " * 20]


def start(tiny: str, log: Path, *extra: str) -> ServerProcess:
    args = ["--model", tiny, "--served-model-name", "tiny", *TINY_FLAGS,
            "--admin-token", ADMIN_TOKEN, *extra]  # fmt: skip
    return ServerProcess(args, log).start()


@pytest.fixture(scope="module")
def servers(tiny_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    thread = start(tiny_path, logs / "thread.log")
    try:
        process = start(tiny_path, logs / "process.log", "--engine-process")
    except BaseException:
        thread.stop()
        raise
    yield thread, process
    thread.stop()
    process.stop()


def engine_processes(pid: int) -> list[int]:
    """The children of pid that multiprocessing spawned (not its resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def answer(server: ServerProcess, prompt: str):
    out = server.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    return choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs


def test_the_engine_runs_in_a_child_process(servers):
    thread, process = servers
    assert engine_processes(thread.process.pid) == []
    assert len(engine_processes(process.process.pid)) == 1


def test_answers_equal_the_engine_thread_s(servers):
    thread, process = servers
    for prompt in PROMPTS:
        assert answer(process, prompt) == answer(thread, prompt)
    kwargs = dict(model="tiny", max_tokens=20, temperature=0,
                  messages=[{"role": "user", "content": "stream me"}])  # fmt: skip
    full = process.client().chat.completions.create(**kwargs).choices[0].message.content
    chunks = process.client().chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert full == thread.client().chat.completions.create(**kwargs).choices[0].message.content


def test_admin_config_and_metrics_cross_the_pipe(servers):
    _, server = servers
    url = f"{server.admin_url}/admin/config"
    before = httpx.get(url, headers=ADMIN).json()["max_num_seqs"]
    bad = httpx.patch(url, json={"block_size": 32}, headers=ADMIN)
    assert bad.status_code == 400 and "cannot be changed" in bad.json()["error"]["message"]
    assert httpx.patch(url, json={"max_num_seqs": 2}, headers=ADMIN).json()["max_num_seqs"] == 2
    try:
        assert httpx.get(url, headers=ADMIN).json()["max_num_seqs"] == 2
        results = []

        def complete(i: int) -> None:
            out = server.client().completions.create(
                model="tiny", prompt=f"batch {i}", max_tokens=120, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            results.append(out.usage.completion_tokens)

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        # The engine process schedules with the new limit; the metrics see its queue.
        wait_for(
            "3 waiting requests",
            lambda: server.metric(names.NUM_REQUESTS_WAITING) == 3,
            timeout=120,
            interval=0.05,
        )
        assert server.metric(names.NUM_REQUESTS_RUNNING) == 2
        for t in threads:
            t.join(300)
        assert results == [120] * 5
    finally:
        httpx.patch(url, json={"max_num_seqs": before}, headers=ADMIN)


def test_a_client_that_goes_away_is_aborted_in_the_engine_process(servers):
    _, server = servers
    stream = server.client().completions.create(
        model="tiny", prompt="abandon me", max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    assert server.metric(names.NUM_REQUESTS_RUNNING) == 1
    stream.close()
    wait_for(
        "no running request",
        lambda: server.metric(names.NUM_REQUESTS_RUNNING) == 0,
        timeout=60,
        interval=0.05,
    )


def test_a_dead_engine_process_fails_health_and_requests(tiny_path, tmp_path):
    server = start(tiny_path, tmp_path / "serve.log", "--engine-process")
    try:
        (engine_pid,) = engine_processes(server.process.pid)
        os.kill(engine_pid, signal.SIGKILL)
        wait_for(
            "/health to answer 503",
            lambda: httpx.get(f"{server.url}/health").status_code == 503,
            timeout=60,
            interval=0.05,
        )
        r = server.http().post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == 500 and "engine failed" in r.json()["error"]["message"]
    finally:
        server.stop()
    assert "the engine process exited with code -9" in server.log()
