"""Work merged per key: ``Coalescer.request(key, value)`` runs ``run(key, value)`` once,
``delay`` seconds after the first request since the last run; requests meanwhile only
replace the value. The reconciler's status refresh from a Deployment's events goes
through one: while a service is made, its Deployment's controller writes the ready count
0, 1, ... 5 in quick turns, and each event was a read of the service, a read of the
Deployment and a status patch (5 patches a service at 1,000 services, the API server's
busiest writes after the pods'). A short wait lets one refresh, which reads the
Deployment as it is then, carry them all.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("batchpilot.operator")


class Coalescer:
    """``delay`` 0 runs each request at once, on the caller's thread (no merging)."""

    def __init__(
        self,
        delay: float,
        run: Callable[[Any, Any], None],
        threads: int = 4,
        name: str = "coalesced",
    ):
        self.delay = delay
        self._run = run
        # key -> (the order of its entry in the heap, when it is due, the latest value)
        self._pending: dict[Hashable, tuple[int, float, Any]] = {}
        self._due: list[tuple[float, int, Hashable]] = []  # a heap: (when, order, key)
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._threads = threads
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._timer: threading.Thread | None = None

    def request(self, key: Hashable, value: Any, delay: float | None = None) -> None:
        """``delay``: this request's, instead of the default; a pending run that is due
        later is brought forward to it."""
        if self.delay <= 0:
            self._run(key, value)
            return
        due = time.monotonic() + (self.delay if delay is None else delay)
        with self._changed:
            order, was_due, _ = self._pending.get(key, (None, None, None))
            if was_due is not None and was_due <= due:
                self._pending[key] = (order, was_due, value)
                return
            order = next(self._order)
            self._pending[key] = (order, due, value)
            heapq.heappush(self._due, (due, order, key))
            self._start()
            self._changed.notify()

    def pending(self) -> int:
        """Keys whose run is still to come."""
        with self._changed:
            return len(self._pending)

    def flush(self) -> None:
        """Run every pending request now, on the caller's thread."""
        with self._changed:
            pending, self._pending = self._pending, {}
        for key, (_, _, value) in pending.items():
            self._run(key, value)

    def _start(self) -> None:
        if self._timer is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
            self._timer = threading.Thread(target=self._wait, name=self._name, daemon=True)
            self._timer.start()

    def _wait(self) -> None:
        while True:
            with self._changed:
                while not self._due or self._due[0][0] > time.monotonic():
                    left = self._due[0][0] - time.monotonic() if self._due else None
                    self._changed.wait(left)  # until the first is due, or a new request
                _, order, key = heapq.heappop(self._due)
                if self._pending.get(key, (None,))[0] != order:
                    continue  # flushed or brought forward (and perhaps requested again)
                value = self._pending.pop(key)[2]  # a request from now on waits anew
            assert self._pool is not None
            self._pool.submit(self._run_logged, key, value)

    def _run_logged(self, key: Hashable, value: Any) -> None:
        try:
            self._run(key, value)
        except Exception:  # as a kopf event handler's failure: logged, the next event retries
            log.exception("%s of %s failed", self._name, key)
