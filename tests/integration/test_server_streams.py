"""Streams a client does not read: the server's memory stays bounded while the engine runs
their sequences to the end, and a client that reads nothing for --stream-stall-timeout has
its request aborted. Raw sockets with a tiny receive buffer play the client that never
reads, so the server's writes really block."""

import json
import socket

from batchpilot import names
from tests.support.servers import ServerProcess
from tests.support.wait import wait_for

MODEL = "tiny"
MAX_TOKENS = 2000
N = 8
# 32 sequences of 2000 tokens at 512 bytes of float32 KV per token fit in 40 MiB.
FLAGS = ("--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "40MiB",
         "--swap-space", "0.02", "--served-model-name", MODEL)  # fmt: skip
# Measured on a 2-core machine: +71 MiB with coalescing (mostly the logprobs the requests
# asked for, kept whatever happens), +1084 MiB with every unread output held (each one its
# own copy of the text and token ids so far: quadratic in the output length).
RSS_GROWTH_BOUND = 256 << 20


def serve(tiny_path, tmp_path, stall_timeout: float) -> ServerProcess:
    args = ["--model", tiny_path, *FLAGS, "--stream-stall-timeout", str(stall_timeout)]
    return ServerProcess(args, tmp_path / "serve.log").start()


def unread_stream(server: ServerProcess) -> socket.socket:
    """A streamed request whose client never reads a byte of the answer."""
    body = json.dumps({"model": MODEL, "prompt": "Go on", "max_tokens": MAX_TOKENS, "n": N,
                       "stream": True, "ignore_eos": True, "logprobs": 1}).encode()  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    sock.sendall(head + body)
    return sock


def rss_bytes(server: ServerProcess) -> int:
    with open(f"/proc/{server.process.pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def generated(server: ServerProcess) -> float:
    return server.metric(names.GENERATION_TOKENS)


def assert_still_serving(server: ServerProcess) -> None:
    out = server.client().completions.create(model=MODEL, prompt="still there?", max_tokens=4)
    assert out.usage.completion_tokens >= 1
    with server.http() as http:
        assert http.get("/health").status_code == 200


def test_unread_streams_keep_the_servers_memory_bounded(tiny_path, tmp_path):
    server = serve(tiny_path, tmp_path, stall_timeout=900)
    try:
        # Warm every code path the streams take (logprobs, n, SSE) before the baseline.
        warm = server.client().completions.create(model=MODEL, prompt="warm", n=N, logprobs=1,
                                                  max_tokens=64, stream=True)  # fmt: skip
        assert sum(1 for _ in warm) > 0
        before_tokens, before_rss = generated(server), rss_bytes(server)
        sockets = [unread_stream(server) for _ in range(4)]
        # The engine finishes every sequence though nobody reads: outputs coalesce.
        target = before_tokens + 4 * N * MAX_TOKENS
        wait_for(
            "the target count of generated tokens",
            lambda: generated(server) >= target,
            timeout=900,
            interval=0.5,
        )
        growth = rss_bytes(server) - before_rss
        assert growth < RSS_GROWTH_BOUND, f"RSS grew {growth >> 20} MiB"
        for sock in sockets:
            sock.close()
        assert_still_serving(server)
    finally:
        server.stop()


def test_a_client_that_reads_nothing_is_aborted_after_the_stall_timeout(tiny_path, tmp_path):
    server = serve(tiny_path, tmp_path, stall_timeout=3)
    try:
        before = generated(server)
        sock = unread_stream(server)
        wait_for(
            "all N streams running",
            lambda: server.metric(names.NUM_REQUESTS_RUNNING) == N,
            timeout=120,
            interval=0.05,
        )
        wait_for("no running request", lambda: server.metric(names.NUM_REQUESTS_RUNNING) == 0, timeout=600,
                   interval=0.5)  # fmt: skip
        # Aborted, not finished: its sequences stopped short of their max_tokens.
        assert generated(server) - before < N * MAX_TOKENS
        assert "the client read nothing for 3 s" in server.log()
        sock.close()
        assert_still_serving(server)
    finally:
        server.stop()
