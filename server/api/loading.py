"""A progress bar while the model loads: one step per start-up stage (the engine's imports,
then each engine load stage), with the elapsed time. On a terminal it redraws in place; in
a log (not a TTY) tqdm writes at most one line every few seconds. Once loaded, one log line
gives the start-up's breakdown (timeline.py; what a cold start from zero replicas waits
for: docs/operations.md)."""

import contextlib
import logging
import sys
import time

from tqdm import tqdm

from batchpilot.server.api.timeline import process_age_seconds, startup_line
from batchpilot.server.model.loader import LOAD_STAGES

logger = logging.getLogger("batchpilot.server")

# torch and the engine's modules, imported on the engine's thread once the server is up.
IMPORT_STAGE = "importing the engine"
STARTUP_STAGES = (IMPORT_STAGE, *LOAD_STAGES)


@contextlib.contextmanager
def loading_progress(model: str):
    """Yields on_stage(name), called as each of STARTUP_STAGES begins."""
    bar = tqdm(
        total=len(STARTUP_STAGES),
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
