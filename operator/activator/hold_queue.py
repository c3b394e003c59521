"""The activator's hold queue of one service: requests waiting for a Ready replica, first in
first out, bounded.

Each held request is an asyncio future that the queue resolves with the backend URL it is
to be forwarded to. The queue never waits or times out itself: the request's handler does
(`asyncio.wait_for`), and drops its future when it gives up or its client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable


class QueueFull(Exception):
    """The service already holds as many requests as it may."""


class HoldQueue:
    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a hold queue holds at least 1 request, not {limit}")
        self.limit = limit
        self._waiting: deque[asyncio.Future[str]] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def hold(self) -> asyncio.Future[str]:
        """A new place at the back of the queue; QueueFull at the bound."""
        if len(self._waiting) >= self.limit:
            raise QueueFull(f"{len(self._waiting)} requests already held")
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        return future

    def drop(self, future: asyncio.Future[str]) -> None:
        """Free a place (its request was forwarded, timed out or disconnected)."""
        with contextlib.suppress(ValueError):  # released already
            self._waiting.remove(future)

    def release(self, pick_backend: Callable[[], str]) -> int:
        """Hand every held request, in arrival order, the backend ``pick_backend`` names
        for it; how many were released. Their handlers resume in that same order."""
        released = 0
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():  # a handler that gave up cancels its own future
                future.set_result(pick_backend())
                released += 1
        return released
