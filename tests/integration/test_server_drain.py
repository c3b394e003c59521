"""SIGTERM drains: /ready turns 503, a request that still arrives is served with `Connection:
close`, every in-flight request (streamed or not) completes, and the process exits 0. Secrets given on the command line never reach
the log."""

import signal
import threading

import httpx
import pytest

from batchpilot import names
from tests.support.servers import TINY_FLAGS, ServerProcess
from tests.support.wait import wait_for

API_KEY = "sk-drain-key-5521"
ADMIN_TOKEN = "drain-admin-7730"


@pytest.mark.parametrize("engine", [(), ("--engine-process",)], ids=["thread", "process"])
def test_sigterm_drains_in_flight_requests_and_exits_zero(tmp_path_factory, engine):
    from tests.support.models import make_tiny_llama

    tiny = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    args = ["--model", tiny, "--served-model-name", "tiny", *TINY_FLAGS, "--api-key", API_KEY,
            "--admin-token", ADMIN_TOKEN, "--shutdown-timeout", "120", *engine]  # fmt: skip
    server = ServerProcess(args, tmp_path_factory.mktemp("drain") / "serve.log", api_key=API_KEY)
    server.start()
    try:
        httpx.get(f"{server.admin_url}/admin/config", headers={"Authorization": "Bearer wrong"})
        results, failures = [], []

        def request(stream: bool, i: int):
            try:
                kwargs = dict(model="tiny", prompt=f"drain {i}", max_tokens=150, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip
                if stream:
                    chunks = list(server.client().completions.create(**kwargs, stream=True))
                    results.append(chunks[-1].choices[0].finish_reason)
                else:
                    out = server.client().completions.create(**kwargs)
                    results.append(out.choices[0].finish_reason)
            except Exception as e:
                failures.append(repr(e))

        threads = [threading.Thread(target=request, args=(i % 2 == 0, i)) for i in range(6)]
        for t in threads:
            t.start()
        wait_for(
            "6 running requests",
            lambda: server.metric(names.NUM_REQUESTS_RUNNING) == 6,
            interval=0.05,
        )

        server.process.send_signal(signal.SIGTERM)
        wait_for(
            "/ready to answer 503",
            lambda: httpx.get(f"{server.url}/ready").status_code == 503,
            timeout=10,
            interval=0.05,
        )
        late = httpx.post(f"{server.url}/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": "late", "max_tokens": 4},
                          headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
        assert late.status_code == 200 and late.json()["usage"]["completion_tokens"] > 0
        assert late.headers["connection"] == "close"
        assert server.metric(names.NUM_REQUESTS_RUNNING) > 0, "drained before the checks ran"

        for t in threads:
            t.join(180)
        assert failures == []
        assert results == ["length"] * 6
        assert server.process.wait(60) == 0
    finally:
        server.stop()
    log = server.log()
    assert "SIGTERM: draining 6 in-flight request(s)" in log
    assert API_KEY not in log and ADMIN_TOKEN not in log and "wrong-guess" not in log
