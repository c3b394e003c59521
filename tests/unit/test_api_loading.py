"""The start-up timeline the server logs: each start-up stage's time and what came before
the first (the interpreter, the server's imports), which a cold start from zero waits for,
read back as `batchpilot bench startup` and the kind test read it; and the first token."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from batchpilot.server.api.loading import STARTUP_STAGES, loading_progress
from batchpilot.server.api.timeline import FirstToken, parse_startup_line, process_age_seconds
from batchpilot.server.model.loader import LOAD_STAGES


def startup_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]


def test_each_stage_is_timed_and_the_process_age_is_counted(caplog):
    caplog.set_level(logging.INFO, logger="batchpilot.server")
    with loading_progress("m") as on_stage:
        for name in STARTUP_STAGES:
            on_stage(name)
            time.sleep(0.05)
    (line,) = startup_messages(caplog)
    times = parse_startup_line(line)
    assert list(times)[:2] == ["process up", "before loading"], line
    assert list(times)[2:] == list(STARTUP_STAGES), line
    assert all(times[s] >= 0.04 for s in STARTUP_STAGES), line
    assert times["process up"] >= sum(times[s] for s in STARTUP_STAGES), line
    assert 0 < process_age_seconds() < 24 * 3600


def test_the_engine_imports_come_before_the_load_stages():
    assert STARTUP_STAGES[1:] == LOAD_STAGES
    assert "import" in STARTUP_STAGES[0]


def test_a_failed_load_logs_no_breakdown(caplog):
    caplog.set_level(logging.INFO, logger="batchpilot.server")
    try:
        with loading_progress("m") as on_stage:
            on_stage(LOAD_STAGES[0])
            raise RuntimeError("no weights")
    except RuntimeError:
        pass
    assert not startup_messages(caplog)


def test_the_timeline_is_read_back_from_a_whole_log():
    log = (
        "INFO 12-05 [uvicorn.access] GET /ready 503\n"
        "INFO 12-05 [batchpilot.server] start-up: process up 3.90 s, before loading 1.10 s; "
        "importing the engine 1.25 s, loading weights 0.01 s, allocating the KV cache 0.40 s\n"
        "INFO 12-05 [batchpilot.server] first token: 4.12 s after the process started\n"
    )
    assert parse_startup_line(log) == {
        "process up": 3.9,
        "before loading": 1.1,
        "importing the engine": 1.25,
        "loading weights": 0.01,
        "allocating the KV cache": 0.4,
        "first token": 4.12,
    }
    assert parse_startup_line("INFO nothing here\n") == {}


def turn(*delta_token_ids: list[int]) -> SimpleNamespace:
    outputs = [SimpleNamespace(outputs=[SimpleNamespace(delta_token_ids=ids)])
               for ids in delta_token_ids]  # fmt: skip
    return SimpleNamespace(outputs=outputs)


def test_the_first_token_is_logged_once_and_only_for_a_token(caplog):
    caplog.set_level(logging.INFO, logger="batchpilot.server")
    first = FirstToken()
    first.observe(turn())  # a step with no output
    first.observe(turn([]))  # an output with no new token (an abort)
    assert not first.seen
    first.observe(turn([], [7]))
    first.observe(turn([8]))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("first token")]
    assert len(lines) == 1, lines
    assert 0 < parse_startup_line("start-up: x 0.00 s\n" + lines[0])["first token"] < 24 * 3600
