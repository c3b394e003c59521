"""Filters on kopf's loggers: what the operator's log and /metrics say about kopf's own
work.

- Kopf starts a watch again from a fresh list when the API server answers 410 Gone (the
  resource version it resumed from was compacted away) and when a stream goes quiet past
  its inactivity timeout, and says so only at debug level. ``WatchRestarts`` counts both
  into batchpilot_operator_watch_restarts, logs them at info level, and keeps the logger's
  other debug lines out unless the operator runs with --debug or --verbose.
- Kopf logs every timer and handler that succeeded at info level: at 1,000 services, six
  thousand lines a minute that say nothing. ``QuietSuccess`` drops them unless --verbose.
"""

from __future__ import annotations

import logging
import re

from batchpilot.operator import probes

WATCHING_LOGGER = "kopf._cogs.clients.watching"
OBJECTS_LOGGER = "kopf.objects"
# The start of kopf's line for each reason (kopf/_cogs/clients/watching.py).
_REASONS = (("Restarting the watch-stream for ", "expired"), ("Watch-stream for ", "inactive"))
_SUCCESS = re.compile(r"(Timer|Handler|Daemon) '[^']*' succeeded\.")


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


class QuietSuccess(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and _SUCCESS.fullmatch(record.getMessage()))


def install(verbose: bool) -> None:
    """Both filters, once per process; ``verbose``: --debug or --verbose."""
    watching = logging.getLogger(WATCHING_LOGGER)
    if not any(isinstance(f, WatchRestarts) for f in watching.filters):
        watching.addFilter(WatchRestarts(verbose))
    watching.setLevel(logging.DEBUG)  # the lines are debug ones: let the filter see them
    objects = logging.getLogger(OBJECTS_LOGGER)
    if not verbose and not any(isinstance(f, QuietSuccess) for f in objects.filters):
        objects.addFilter(QuietSuccess())
