"""Repository-wide pytest hooks: how long each test tier took.

Every run ends with a table of the time spent per tier (unit, slow, cluster, kind: the markers
of docs/testing.md), so a slow CI run says where its minutes went. With
``$BATCHPILOT_TIER_TIMES`` set, the table is also written there as JSON for `.ci/run`'s own
summary.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest

TIERS = ("unit", "slow", "cluster", "kind")
_seconds: dict[str, float] = defaultdict(float)
_counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_started = time.monotonic()


def tier_of(keywords) -> str:
    """The most expensive tier a test belongs to: a slow test that also needs the control
    plane is counted as cluster, since that is what it waits on."""
    for tier in ("kind", "cluster", "slow"):
        if tier in keywords:
            return tier
    return "unit"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Setup and teardown count too: session fixtures (a control plane, a kind cluster) are
    # paid for in the first test's setup and belong to that test's tier.
    tier = tier_of(report.keywords)
    _seconds[tier] += report.duration
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _counts[tier][report.outcome] += 1


def tier_rows() -> list[dict]:
    return [
        {"tier": tier, "seconds": round(_seconds[tier], 1), **dict(_counts[tier])}
        for tier in TIERS
        if tier in _seconds
    ]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    rows = tier_rows()
    if not rows:
        return
    terminalreporter.section("time per tier")
    terminalreporter.write_line(f"{'tier':<8} {'tests':>6} {'failed':>6} {'minutes':>8}")
    for row in rows:
        tests = sum(v for k, v in row.items() if k not in ("tier", "seconds"))
        terminalreporter.write_line(
            f"{row['tier']:<8} {tests:>6} {row.get('failed', 0):>6} {row['seconds'] / 60:>8.1f}"
        )
    wall = time.monotonic() - _started
    terminalreporter.write_line(f"{'pytest':<8} {'':>6} {'':>6} {wall / 60:>8.1f}")
    target = os.environ.get("BATCHPILOT_TIER_TIMES")
    if target:
        with open(target, "w") as f:
            json.dump({"tiers": rows, "pytest_seconds": round(wall, 1)}, f, indent=1)
