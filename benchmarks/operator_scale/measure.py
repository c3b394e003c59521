"""The benchmark's arithmetic, kept pure so a unit test can pin it: the API server's
request counters and their rates, the gaps between a service's loop turns, and whether a
process talked to anything but loopback. Readers of /proc sit at the bottom."""

from __future__ import annotations

import ipaddress
import itertools
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime

from prometheus_client.parser import text_string_to_metric_families

APPLIED = "Applied generation"
REQUEST_TOTAL = "apiserver_request"  # apiserver_request_total, as the parser names it
# (verb, resource, subresource): the unit the API server counts requests in.
RequestKey = tuple[str, str, str]


def request_counts(metrics_text: str) -> Counter[RequestKey]:
    """apiserver_request_total summed over code, group, version, scope and component."""
    counts: Counter[RequestKey] = Counter()
    for family in text_string_to_metric_families(metrics_text):
        if family.name != REQUEST_TOTAL:
            continue
        for sample in family.samples:
            if sample.name != REQUEST_TOTAL + "_total":
                continue
            labels = sample.labels
            key = (
                labels.get("verb", ""),
                labels.get("resource", ""),
                labels.get("subresource", ""),
            )
            counts[key] += sample.value
    return counts


def request_delta(
    before: Mapping[RequestKey, float], after: Mapping[RequestKey, float]
) -> Counter[RequestKey]:
    """Requests made between two scrapes. WATCH counts connections opened, not events."""
    keys = set(before) | set(after)
    delta = Counter({k: after.get(k, 0) - before.get(k, 0) for k in keys})
    return Counter({k: v for k, v in delta.items() if v > 0})


def per_minute_by_verb(delta: Mapping[RequestKey, float], seconds: float) -> dict[str, float]:
    by_verb: Counter[str] = Counter()
    for (verb, _, _), n in delta.items():
        by_verb[verb] += n
    return {verb: round(n * 60 / seconds, 1) for verb, n in sorted(by_verb.items())}


def per_minute_by_request(delta: Mapping[RequestKey, float], seconds: float) -> dict[str, float]:
    """Each (verb, resource/subresource) as 'VERB resource/sub', for where the load is."""
    rows = {
        f"{verb} {resource}{'/' + sub if sub else ''}": round(n * 60 / seconds, 1)
        for (verb, resource, sub), n in delta.items()
    }
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def turn_gaps(times: Iterable[float], start: float, end: float) -> float:
    """The longest a service went without a loop turn over the window [start, end], given
    the times of its turns seen: the gaps between turns, counting from its last turn
    before the window (or the window's start) and up to the window's end, so a service
    that stopped being observed shows the whole silence."""
    seen = set(times)
    before = [t for t in seen if t < start]
    inside = sorted(t for t in seen if start <= t <= end)
    edges = [max(before, default=start), *inside, end]
    return max(b - a for a, b in itertools.pairwise(edges))


def without(delta: Mapping[RequestKey, float], own: Mapping[RequestKey, float]) -> Counter:
    """The requests in `delta` less the benchmark's own."""
    return request_delta(own, delta)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q / 100 * len(ranked)) - 1)]


def non_loopback(addresses: Iterable[str]) -> list[str]:
    """The remote addresses that are not loopback (IPv4 127/8, ::1, or v4-mapped 127/8)."""
    bad = []
    for address in addresses:
        ip = ipaddress.ip_address(address)
        mapped = getattr(ip, "ipv4_mapped", None)
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            bad.append(address)
    return sorted(set(bad))


def first_applies(log_lines: Iterable[str]) -> dict[str, float]:
    """When the operator first applied each service's children (its JSON log's "Applied
    generation" line): how long the operator's own part of reconcile_all took, apart from
    the controllers' and kwok's."""
    applied: dict[str, float] = {}
    for line in log_lines:
        if APPLIED not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("message", "").startswith(APPLIED):
            when = datetime.fromisoformat(entry["timestamp"]).timestamp()
            applied.setdefault(entry["object"]["name"], when)
    return applied


# --------------------------------------------------------------------------- /proc readers


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system time of the process (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    """Is the process still running (not exited, not a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
