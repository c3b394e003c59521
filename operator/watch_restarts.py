"""Kopf starts a watch again from a fresh list when the API server answers 410 Gone (the
resource version it resumed from was compacted away) and when a stream goes quiet past its
inactivity timeout, and says so only at debug level. This filter on kopf's watching logger
counts both into batchpilot_operator_watch_restarts, logs them at info level, and keeps
the logger's other debug lines out unless the operator runs with --debug or --verbose."""

from __future__ import annotations

import logging

from batchpilot.operator import probes

WATCHING_LOGGER = "kopf._cogs.clients.watching"
# The start of kopf's line for each reason (kopf/_cogs/clients/watching.py).
_REASONS = (("Restarting the watch-stream for ", "expired"), ("Watch-stream for ", "inactive"))


def restart_reason(message: str) -> tuple[str, str] | None:
    """(resource, reason) of a kopf watch-restart line; None for any other line."""
    for prefix, reason in _REASONS:
        if message.startswith(prefix) and (reason != "inactive" or "is inactive" in message):
            return message[len(prefix) :].split(" ", 1)[0], reason
    return None


class WatchRestarts(logging.Filter):
    def __init__(self, show_debug: bool):
        super().__init__()
        self.show_debug = show_debug

    def filter(self, record: logging.LogRecord) -> bool:
        restart = restart_reason(record.getMessage())
        if restart is not None:
            probes.WATCH_RESTARTS.labels(*restart).inc()
            record.levelno, record.levelname = logging.INFO, "INFO"
            return True
        return self.show_debug or record.levelno >= logging.INFO


def install(show_debug: bool) -> None:
    """Count watch restarts from now on (once per process)."""
    logger = logging.getLogger(WATCHING_LOGGER)
    if not any(isinstance(f, WatchRestarts) for f in logger.filters):
        logger.addFilter(WatchRestarts(show_debug))
    logger.setLevel(logging.DEBUG)  # the lines are debug ones: let the filter see them
