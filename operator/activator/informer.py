"""A list-then-watch loop on a thread, feeding an Index (routes.py): the informer pattern of
client-go, small. It lists (the index is replaced), watches from the list's resourceVersion,
and lists again when the watch ends (its timeout, an expired version, a dropped connection),
so a missed event lasts at most one watch period."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kubernetes import watch

from batchpilot.operator.activator.routes import Index
from batchpilot.operator.kube import TIMEOUT

logger = logging.getLogger(__name__)

WATCH_SECONDS = 300  # a fresh list at least this often
MAX_BACKOFF_SECONDS = 30.0


class Informer(threading.Thread):
    def __init__(self, name: str, list_fn: Callable, index: Index, stop: threading.Event,
                 **list_args):  # fmt: skip
        super().__init__(name=name, daemon=True)
        self.list_fn, self.index, self.stop_event, self.list_args = list_fn, index, stop, list_args

    def run(self) -> None:
        backoff = 1.0
        while not self.stop_event.is_set():
            try:
                self._list_and_watch()
                backoff = 1.0
            except Exception as e:  # the API server: try again, slower each time
                logger.warning("%s: %r; listing again in %.0f s", self.name, e, backoff)
                self.stop_event.wait(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_SECONDS)

    def _list_and_watch(self) -> None:
        listed = self.list_fn(**self.list_args, _request_timeout=TIMEOUT)
        self.index.replace(listed.items)
        stream = watch.Watch().stream(
            self.list_fn, **self.list_args, resource_version=listed.metadata.resource_version,
            timeout_seconds=WATCH_SECONDS, _request_timeout=(TIMEOUT[0], WATCH_SECONDS + TIMEOUT[1]),
        )  # fmt: skip
        for event in stream:
            if self.stop_event.is_set():
                return
            if event["type"] == "ERROR":  # 410 Gone and the like: list again
                return
            if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                self.index.apply(event["type"], event["object"])
