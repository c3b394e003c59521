"""A tenant's replica may answer anything: the operator reads /metrics and the admin API's
answers no further than their byte limits (operator/bounds.py) and within a total timeout,
and a replica that answers more is a failed scrape or call with a clear message, never a
whole gigabyte in the operator's memory.

The replicas here are real HTTP servers on 127.0.0.1 (http.server in a thread) that stream a
huge body; tracemalloc measures what the operator held while it read."""

from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batchpilot.operator.bounds import ADMIN_MAX_BYTES, METRICS_MAX_BYTES
from batchpilot.operator.loop.admin_client import AdminClient, AdminError
from batchpilot.operator.loop.scrape import scrape_urls

CHUNK = b"x" * (64 << 10)
# "Huge": far past every limit, yet finite, so that an operator that reads it all (the
# unfixed one) still ends, having held it, instead of exhausting the test machine.
HUGE_BYTES = 256 << 20
TOKEN = "secret"


@dataclass
class Answer:
    """What the replica answers every request with: ``status``, then ``size`` bytes (at most
    HUGE_BYTES) written ``chunk`` bytes every ``pause`` seconds; ``declared`` sends that
    size as Content-Length, else the body runs until the connection closes."""

    status: int = 200
    size: int = HUGE_BYTES
    declared: bool = False
    chunk: bytes = CHUNK
    pause: float = 0.0
    sent: int = 0  # bytes the replica got onto the socket before the operator hung up


def handler(answer: Answer) -> type[BaseHTTPRequestHandler]:
    class Replica(BaseHTTPRequestHandler):
        def answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(answer.status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            if answer.declared:
                self.send_header("Content-Length", str(answer.size))
            self.end_headers()
            try:
                while answer.sent < answer.size:
                    piece = answer.chunk[: answer.size - answer.sent]
                    self.wfile.write(piece)
                    answer.sent += len(piece)
                    time.sleep(answer.pause)
            except OSError:  # the operator closed the connection: what it should do
                pass

        do_GET = do_POST = do_PATCH = answer

        def log_message(self, *args) -> None:
            pass

    return Replica


@contextmanager
def replica(answer: Answer) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(answer))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def measured(call) -> tuple[object, float, int]:
    """(result, seconds, peak bytes traced) of running the coroutine ``call``."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        result = asyncio.run(call)
        return result, time.monotonic() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --------------------------------------------------------------------------- /metrics


@pytest.mark.parametrize("declared", [False, True], ids=["streamed", "content-length"])
def test_a_huge_metrics_answer_is_a_failed_scrape_read_no_further_than_the_limit(declared):
    answer = Answer(declared=declared)
    with replica(answer) as url:
        (scrape,), seconds, peak = measured(scrape_urls({url: url}, timeout=5))
    assert scrape.text is None
    assert scrape.error == f"AnswerTooLarge: answer over {METRICS_MAX_BYTES} bytes"
    assert seconds < 2.5, "stopped at the limit, not at the timeout"
    assert peak < 4 * METRICS_MAX_BYTES, f"held {peak} bytes"
    assert answer.sent < HUGE_BYTES // 4, "hung up, did not drain the answer"


def test_metrics_up_to_the_limit_are_read_whole():
    with replica(Answer(size=METRICS_MAX_BYTES, chunk=b"# comment line\n" * 4096)) as url:
        (scrape,) = asyncio.run(scrape_urls({url: url}, timeout=5))
    assert scrape.error is None and len(scrape.text) == METRICS_MAX_BYTES


def test_a_replica_that_trickles_its_metrics_is_cut_by_the_total_timeout():
    """Under the byte limit for ever: the session's total timeout, body included, ends it."""
    with replica(Answer(chunk=b"#", pause=0.05)) as url:
        (scrape,), seconds, _ = measured(scrape_urls({url: url}, timeout=1))
    assert scrape.error is not None and scrape.error.startswith("TimeoutError")
    assert seconds < 3


# --------------------------------------------------------------------------- admin API


@pytest.mark.parametrize("status", [200, 503])
def test_a_huge_admin_config_answer_is_a_failed_call(status):
    answer = Answer(status=status)
    with replica(answer) as url:
        failures, seconds, peak = measured(
            AdminClient(timeout=5).set_live([url], TOKEN, {"max_num_seqs": 8})
        )
    assert f"answer over {ADMIN_MAX_BYTES} bytes" in failures[url]
    assert seconds < 2.5
    assert peak < 16 * ADMIN_MAX_BYTES, f"held {peak} bytes"
    assert answer.sent < HUGE_BYTES // 4


def test_a_huge_adapter_refusal_is_a_failed_call_not_a_refusal():
    """A 400 whose body passes the limit says nothing readable of the adapter."""
    with replica(Answer(status=400)) as url:
        client = AdminClient(timeout=5, adapter_timeout=5)
        start = time.monotonic()
        with pytest.raises(AdminError, match=f"answer over {ADMIN_MAX_BYTES} bytes") as e:
            asyncio.run(client.load_adapter(url, TOKEN, "sql", "/adapters/sql"))
    assert type(e.value) is AdminError
    assert time.monotonic() - start < 2.5


def test_a_huge_models_list_reads_as_unknown():
    answer = Answer()
    with replica(answer) as url:
        loaded, seconds, _ = measured(AdminClient(timeout=5).list_adapters(url, TOKEN))
    assert loaded is None and seconds < 2.5
    assert answer.sent < HUGE_BYTES // 4


def test_an_admin_answer_that_trickles_is_cut_by_the_total_timeout():
    with replica(Answer(chunk=b"{", pause=0.05)) as url:
        start = time.monotonic()
        with pytest.raises(AdminError, match="TimeoutError"):
            asyncio.run(AdminClient(timeout=1).get_config(url, TOKEN))
    assert time.monotonic() - start < 3
