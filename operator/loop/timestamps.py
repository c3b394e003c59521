"""The loop's time format: RFC 3339 in UTC with milliseconds, in status and in the
activator's wake annotation (which the loop compares with the times in status)."""

from __future__ import annotations

from datetime import UTC, datetime


def timestamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_timestamp(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


def maybe_timestamp(value: object) -> float | None:
    """A time read back from the cluster: None when absent or unreadable (hand-edited)."""
    try:
        return parse_timestamp(value) if isinstance(value, str) else None
    except ValueError:
        return None
