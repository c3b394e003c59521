"""A progress bar while the model loads: one step per engine load stage, with the
elapsed time. On a terminal it redraws in place; in a log (not a TTY) tqdm writes at most
one line every few seconds. Once loaded, one log line gives the start-up's breakdown (what
a cold start from zero replicas waits for: docs/operations.md)."""

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from batchpilot.server.model.loader import LOAD_STAGES

logger = logging.getLogger("batchpilot.server")


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux /proc), so the breakdown includes the
    interpreter's start and the imports before the first stage."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError):
        return None


def startup_line(stages: dict[str, float], age: float | None) -> str:
    parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in stages.items())
    before = (
        ""
        if age is None
        else f"process up {age:.2f} s, before loading {age - sum(stages.values()):.2f} s; "
    )
    return f"start-up: {before}{parts}"


@contextlib.contextmanager
def loading_progress(model: str):
    """Yields on_stage(name) for LLMEngine(on_stage=...)."""
    bar = tqdm(
        total=len(LOAD_STAGES),
        desc=f"Loading {model}",
        bar_format="{desc} |{bar:20}| {n_fmt}/{total_fmt} [{elapsed}]",
        mininterval=0.1 if sys.stderr.isatty() else 5.0,
        file=sys.stderr,
    )
    stages: dict[str, float] = {}
    current: list = []  # [name, started]

    def close_stage() -> None:
        if current:
            stages[current[0]] = time.monotonic() - current[1]

    def on_stage(name: str) -> None:
        if current:
            bar.update(1)
        close_stage()
        current[:] = [name, time.monotonic()]
        bar.set_description_str(f"Loading {model}: {name}")

    try:
        yield on_stage
        close_stage()
        bar.update(bar.total - bar.n)
        bar.set_description_str(f"Loading {model}: ready")
    finally:
        bar.close()
    logger.info(startup_line(stages, process_age_seconds()))
