"""Polling until a condition holds: the one `wait_for` (threads) and `eventually` (asyncio)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

# Generous: the machines the tests run on are shared and often loaded.
DEFAULT_TIMEOUT = 120.0


def wait_for(
    what: str,
    predicate: Callable[[], Any],
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.2,
    not_yet: Callable[[Exception], bool] | None = None,
) -> Any:
    """Call predicate every `interval` s until it returns something truthy, and return that.

    An exception for which not_yet(e) is true counts as "not yet" (e.g. a 404 for an object
    still being made); any other propagates. Past `timeout` s, fails with an
    AssertionError naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except Exception as e:
            if not_yet is None or not not_yet(e):
                raise
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}; last value: {value!r}"
            )
        time.sleep(interval)


async def eventually(
    what: str,
    predicate: Callable[[], Any],
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.02,
) -> None:
    """wait_for on the event loop: sleeps with asyncio, so the code under test runs."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}; last value: {value!r}"
            )
        await asyncio.sleep(interval)
