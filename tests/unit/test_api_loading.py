"""The start-up breakdown the server logs once loaded: each load stage's time and what came
before the first (the interpreter, the imports), which a cold start from zero waits for."""

from __future__ import annotations

import logging
import re
import time

from batchpilot.server.api.loading import loading_progress, process_age_seconds
from batchpilot.server.model.loader import LOAD_STAGES


def test_each_stage_is_timed_and_the_process_age_is_counted(caplog):
    caplog.set_level(logging.INFO, logger="batchpilot.server")
    with loading_progress("m") as on_stage:
        for name in LOAD_STAGES:
            on_stage(name)
            time.sleep(0.05)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]
    times = dict(re.findall(r"([a-zA-Z][a-zA-Z ]+?) (\d+\.\d+) s", line))
    assert set(LOAD_STAGES) <= set(times), line
    assert all(float(times[s]) >= 0.04 for s in LOAD_STAGES), line
    age = float(times["process up"])
    assert age >= sum(float(times[s]) for s in LOAD_STAGES), line
    assert 0 < process_age_seconds() < 24 * 3600


def test_a_failed_load_logs_no_breakdown(caplog):
    caplog.set_level(logging.INFO, logger="batchpilot.server")
    try:
        with loading_progress("m") as on_stage:
            on_stage(LOAD_STAGES[0])
            raise RuntimeError("no weights")
    except RuntimeError:
        pass
    assert not [r for r in caplog.records if r.getMessage().startswith("start-up:")]
