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


def split_cpus(server_cpus: set[int] | None) -> tuple[set[int], set[int]]:
    """(the server's CPUs, the benchmark's): by default the last CPU serves and the others
    run the load generator and the loop; on one CPU both share it."""
    cpus = os.sched_getaffinity(0)
    server = server_cpus or {max(cpus)}
    return server, (cpus - server) or cpus


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
