"""Hostile requests against a live `batchpilot serve` (the tiny random Llama): each one is
refused with a 4xx in OpenAI's error shape, and after each a normal request still
succeeds and /health is 200. Then the queue bound counts a request's sequences as a
whole, a 4 MiB amplification body is refused quickly without growing the server, and so is
a header flood, on both ports."""

import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from batchpilot import names
from batchpilot.server.api.protocol import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_SEQS_PER_REQUEST,
    MAX_STOP_STRING_CHARS,
)
from tests.support.servers import TINY_FLAGS, ServerProcess
from tests.support.wait import wait_for

MODEL = "tiny"
ADMIN_TOKEN = "admin-token-hostile-7c2a"
MAX_MODEL_LEN = 2048  # room for a request that runs long enough to fill the queue behind it
MAX_QUEUE_LEN = 4
OOV = 10**9  # past any vocabulary
LONGEST_TOKEN_CHARS = 81  # SmolLM2's: a newline and 80 spaces
TOO_MANY_CHARS = MAX_MODEL_LEN * LONGEST_TOKEN_CHARS + 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support.models import make_tiny_llama

    tiny = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    # One running sequence and a queue of 4, so the queue bound can be filled on purpose.
    args = ["--model", tiny, "--served-model-name", MODEL, *TINY_FLAGS, "--max-num-seqs", "1",
            "--max-queue-len", str(MAX_QUEUE_LEN), "--max-model-len", str(MAX_MODEL_LEN),
            "--admin-token", ADMIN_TOKEN]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("hostile") / "serve.log").start()
    yield proc
    proc.stop()


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"prompt": "hi", "max_tokens": 4, **fields}


CMPL, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"

# (name, path, JSON body or raw bytes, expected status)
HOSTILE = [
    ("malformed json", CMPL, b'{"prompt": "hi", ', 400),
    ("not an object", CMPL, b"[1, 2, 3]", 400),
    ("NaN temperature", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400),
    ("Infinity top_p", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', 400),
    ("1e999 repetition_penalty", CMPL, b'{"prompt": "hi", "repetition_penalty": 1e999}', 400),
    ("-Infinity presence_penalty", CMPL, b'{"prompt": "hi", "presence_penalty": -Infinity}', 400),
    ("NaN logit_bias value", CMPL, b'{"prompt": "hi", "logit_bias": {"1": NaN}}', 400),
    ("n x prompts over the cap", CMPL, completion(prompt=["a"] * MAX_SEQS_PER_REQUEST, n=2), 400),
    ("prompt batch over the cap", CMPL, completion(prompt=[[1]] * 5000), 400),
    ("more sequences than the queue", CMPL, completion(n=MAX_QUEUE_LEN + 1), 400),
    ("OOV stop id with min_tokens", CMPL, completion(stop_token_ids=[OOV], min_tokens=2), 400),
    ("OOV stop id in chat", CHAT, chat(stop_token_ids=[OOV], min_tokens=2), 400),
    ("stop id past int64", CMPL, completion(stop_token_ids=[1 << 64]), 400),
    ("OOV logit_bias key", CMPL, completion(logit_bias={str(OOV): 5}), 400),
    ("negative logit_bias key", CMPL, completion(logit_bias={"-1": 5}), 400),
    ("5000-digit logit_bias key", CMPL, completion(logit_bias={"9" * 5000: 5}), 400),
    ("logit_bias over the cap", CMPL,
     completion(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}), 400),
    ("OOV prompt id", CMPL, completion(prompt=[[1, OOV]]), 400),
    ("top_k past the vocabulary", CMPL, completion(top_k=OOV), 400),
    ("top_k past int64", CHAT, chat(top_k=1 << 70), 400),
    ("giant stop string", CMPL, completion(stop="x" * 100_000), 400),
    ("stop string over the cap", CHAT, chat(stop=["y" * (MAX_STOP_STRING_CHARS + 1)]), 400),
    ("too many stop strings", CMPL, completion(stop=["s"] * 17), 400),
    ("prompt longer than the context can hold", CMPL, completion(prompt="a" * TOO_MANY_CHARS), 400),
    ("chat longer than the context can hold", CHAT,
     {"messages": [{"role": "user", "content": "b" * TOO_MANY_CHARS}]}, 400),
    ("token prompt longer than the context", CMPL, completion(prompt=[1] * (MAX_MODEL_LEN + 1)), 400),
    ("/tokenize longer than the context", TOKENIZE, {"prompt": "c" * TOO_MANY_CHARS}, 400),
    ("max_tokens past the context", CMPL, completion(max_tokens=10**30), 400),
    ("seed past int64", CMPL, completion(seed=1 << 64), 400),
    ("min_tokens past max_tokens", CMPL, completion(min_tokens=10**30), 400),
    ("unknown role", CHAT, {"messages": [{"role": "root", "content": "hi"}]}, 400),
]  # fmt: skip


def assert_openai_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert set(error) == {"message", "type", "param", "code"}


def assert_still_serving(server) -> None:
    out = server.client().completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("name, path, body, status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_request_is_refused_and_the_server_goes_on(server, name, path, body, status):
    with server.http() as http:
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            response = http.post(path, json=body)
    assert_openai_error(response, status)
    assert_still_serving(server)


def test_the_queue_bound_counts_a_requests_sequences_and_refuses_it_whole(server):
    """max_num_seqs 1: one request runs, the next waits. With 3 sequences waiting, n=2
    overflows a queue of 4 and is refused whole (nothing of it queued); n=1 fits."""
    results: list = []

    def generate(**fields):
        out = server.client().completions.create(model=MODEL, prompt="go on", temperature=0,
                                                 extra_body={"ignore_eos": True}, **fields)  # fmt: skip
        results.append([c.finish_reason for c in out.choices])

    running = threading.Thread(target=generate, kwargs={"max_tokens": MAX_MODEL_LEN - 8})
    running.start()
    wait_for(
        "1 running request",
        lambda: server.metric(names.NUM_REQUESTS_RUNNING) == 1,
        timeout=120,
        interval=0.05,
    )
    queued = threading.Thread(target=generate, kwargs={"max_tokens": 2, "n": 3})
    queued.start()
    wait_for(
        "3 waiting requests",
        lambda: server.metric(names.NUM_REQUESTS_WAITING) == 3,
        timeout=120,
        interval=0.05,
    )

    with server.http() as http:
        refused = http.post(CMPL, json=completion(n=2))
    assert_openai_error(refused, 429)
    assert "3 sequences, and this request adds 2" in refused.json()["error"]["message"]
    fits = threading.Thread(target=generate, kwargs={"max_tokens": 2, "n": 1})
    fits.start()
    for thread in (running, queued, fits):
        thread.join(300)
    assert sorted(results, key=len) == [["length"], ["length"], ["length"] * 3]


# Bodies near the 4 MiB limit that are wrong in every item: pydantic would report one error
# per item (seconds of event-loop time); the server stops at the first bad item.
ERROR_HEAVY = [
    ("200k bad roles", CHAT, {"messages": [{"role": "x"}] * 200_000}),
    ("200k bad content parts", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "x"}] * 200_000}]}),
    ("200k bad logit_bias values", CMPL, completion(logit_bias={str(i): "x" for i in range(200_000)})),
    ("500k bad token ids", "/detokenize", {"tokens": ["x"] * 500_000}),
    ("500k bad stop ids", CMPL, completion(stop_token_ids=["x"] * 500_000)),
    ("a batch of 500k bad prompts", CMPL, completion(prompt=[None] * 500_000)),
]  # fmt: skip


@pytest.mark.parametrize("name, path, body", ERROR_HEAVY, ids=[e[0] for e in ERROR_HEAVY])
def test_a_body_wrong_in_every_item_is_refused_at_the_first(server, name, path, body):
    with server.http() as http:
        response = http.post(path, json=body)
    assert_openai_error(response, 400)
    more = re.search(r"\(and (\d+) more error", response.json()["error"]["message"])
    assert more is None or int(more[1]) < 5  # one per union member at most, not per item
    assert_still_serving(server)


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def test_a_4_mib_amplification_body_is_refused_quickly_in_bounded_memory(server):
    """[[1],[1],...] in 4 MiB is a million prompts; with n=128 it asked for over a
    hundred million sequences. It is refused before any is built."""
    prompts = b",".join([b"[1]"] * ((4 << 20) // 4 - 16))
    body = b'{"n": 128, "max_tokens": 1, "prompt": [' + prompts + b"]}"
    assert len(body) <= 4 << 20  # under --max-request-body-bytes: parsed, not 413
    pid = server.process.pid
    rss_before = _rss_kib(pid)
    started = time.monotonic()
    with server.http() as http:
        response = http.post(CMPL, content=body, headers={"Content-Type": "application/json"})
    elapsed = time.monotonic() - started
    assert_openai_error(response, 400)
    assert "at most 256 prompts" in response.json()["error"]["message"]
    # Parsing the JSON alone builds a million small lists (about 100 MiB at peak); a
    # hundred million engine requests would be tens of GiB.
    grown_mib = (_rss_kib(pid) - rss_before) / 1024
    assert grown_mib < 256, f"RSS grew by {grown_mib:.0f} MiB"
    assert elapsed < 30, f"took {elapsed:.1f} s"  # about 1 s on an idle machine
    assert_still_serving(server)


# A head that never ends, as a client could send it: a request line, one header or many.
FLOOD_BYTES = 64 << 20
FLOODS = {
    "request line": (b"GET /v1/models?q=", b"a" * (64 << 10)),
    "one header": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ", b"a" * (64 << 10)),
    "many headers": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n", b"X-Many: 0123456789\r\n" * 3000),
}  # fmt: skip


def flood(port: int, start: bytes, filler: bytes) -> tuple[bytes, int]:
    """Send start, then filler until FLOOD_BYTES are sent or the server closes; return its
    answer (b"" if none within 30 s) and the bytes sent. A small send buffer keeps what
    the sockets hold, and so the bytes sent after the server stopped reading, under 1 MiB."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        try:
            sock.sendall(start)
            while sent < FLOOD_BYTES:
                sock.sendall(filler)
                sent += len(filler)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection
        sock.settimeout(30)
        try:
            return sock.recv(4096), sent
        except (TimeoutError, ConnectionResetError):
            return b"", sent


@pytest.mark.parametrize("kind", FLOODS)
@pytest.mark.parametrize("port", ["public", "admin"])
def test_a_header_flood_is_refused_with_431_quickly_in_flat_memory(server, port, kind):
    """The limit is --h11-max-incomplete-event-size (16 KiB), for httptools as for h11:
    before, 48 MiB of one header grew the server by 130 MiB and got no answer."""
    pid = server.process.pid
    rss_before = _rss_kib(pid)
    started = time.monotonic()
    answer, sent = flood(server.admin_port if port == "admin" else server.port, *FLOODS[kind])
    elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer
    assert sent < FLOOD_BYTES // 8, f"{sent} bytes sent before the server closed"
    assert elapsed < 10, f"answered after {elapsed:.1f} s"  # milliseconds on an idle machine
    grown_mib = (_rss_kib(pid) - rss_before) / 1024
    assert grown_mib < 4, f"RSS grew by {grown_mib:.1f} MiB"
    assert_still_serving(server)
    admin = httpx.get(f"{server.admin_url}/admin/config", timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})  # fmt: skip
    assert admin.status_code == 200, admin.text
