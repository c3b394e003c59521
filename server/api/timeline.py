"""The server's start-up timeline: one `start-up:` log line with the seconds each stage
took, from the process's start to the engine being loaded, and a `first token:` line when
the first token comes out. kind-tests/test_kind_zero.py and `batchpilot bench startup`
read them back (parse_startup_line), so the format is `name S.SS s`, comma-separated."""

import logging
import os
import re
import time
from pathlib import Path

logger = logging.getLogger("batchpilot.server")

STAGE = re.compile(r"([a-zA-Z][a-zA-Z ]+?) (\d+\.\d+) s")


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


def parse_startup_line(log: str) -> dict[str, float]:
    """The stages of the first `start-up:` line in a server's log, and `first token` if
    logged; {} without one."""
    line = re.search(r"start-up: (.*)", log)
    if line is None:
        return {}
    stages = {name: float(s) for name, s in STAGE.findall(line.group(1))}
    first = re.search(r"first token: (\d+\.\d+) s", log)
    if first is not None:
        stages["first token"] = float(first.group(1))
    return stages


class FirstToken:
    """Logs `first token: S.SS s` (the process's age) once, when the first generated token
    comes out of the engine: the end of the cold start a request held at zero waits for."""

    def __init__(self):
        self.seen = False

    def observe(self, turn) -> None:
        """turn: an engine/core.py Turn, on the event loop."""
        if self.seen or not any(c.delta_token_ids for o in turn.outputs for c in o.outputs):
            return
        self.seen = True
        age = process_age_seconds()
        if age is not None:
            logger.info("first token: %.2f s after the process started", age)
