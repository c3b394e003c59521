"""The machine the run is on, CPU pinning, and a CPU hog to put beside the server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys


def lscpu() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor", "Flags")
    return {k: fields[k] for k in keep if k in fields}


def load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def parse_cpu_sets(text: str) -> list[set[int]]:
    """'0,1' -> [{0}, {1}]; '0-1,2+3' -> [{0, 1}, {2, 3}]: one CPU set per server."""
    sets = []
    for item in text.split(","):
        cpus: set[int] = set()
        for part in item.split("+"):
            lo, _, hi = part.partition("-")
            cpus |= set(range(int(lo), int(hi or lo) + 1))
        sets.append(cpus)
    return sets


def split_cpus(servers: int, cpus: set[int]) -> list[set[int]]:
    """``cpus`` dealt into ``servers`` disjoint sets of equal size (the leftover CPUs go to
    the load generator); with fewer CPUs than servers, servers share round-robin."""
    ordered = sorted(cpus)
    each = len(ordered) // servers
    if each == 0:
        return [{ordered[i % len(ordered)]} for i in range(servers)]
    return [set(ordered[i * each : (i + 1) * each]) for i in range(servers)]


def bench_cpus(server_sets: list[set[int]], cpus: set[int]) -> set[int]:
    """The load generator's and the loop's CPUs: those no server has, else all of them
    (shared with the servers, as on a 2-core machine with one core per server)."""
    return (cpus - set().union(*server_sets)) or cpus


@contextlib.contextmanager
def affinity(cpus: set[int]):
    """This process (and what it spawns meanwhile) on ``cpus``."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class Hog:
    """A Python busy loop pinned to ``cpus``, paused and resumed with SIGSTOP/SIGCONT."""

    def __init__(self, cpus: set[int]):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(self.proc.pid, cpus)
        self.on = True
        self.set(False)

    def set(self, on: bool) -> None:
        if on != self.on:
            os.kill(self.proc.pid, signal.SIGCONT if on else signal.SIGSTOP)
            self.on = on

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
