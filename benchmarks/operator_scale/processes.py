"""The processes a point runs beside the control plane: the fake replicas and the
operator, each in its own process group, and a watcher of the operator's connections."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from benchmarks.operator_scale.measure import non_loopback

ROOT = Path(__file__).resolve().parents[2]
# Long enough for any check of tests/support/cluster.py's kind (MIN_ADMIN_KEY_CHARS).
ADMIN_KEY = "operator-scale-bench-admin-key-0123456789abcdef"
CONNECTION_SAMPLE_SECONDS = 1.0


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def start_fake_replicas(ports: list[int], log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "benchmarks.operator_scale.fake_replicas", *map(str, ports)]
    return _spawn(argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, log)


def start_operator(
    cluster_env: dict[str, str], namespace: str, ports: list[int], liveness: str, log: Path
) -> subprocess.Popen:
    """`python -m batchpilot operator` at its default intervals, reading the fake replicas
    (one list of URLs for every service)."""
    urls = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    env = {
        **cluster_env,
        "BATCHPILOT_ADMIN_KEY": ADMIN_KEY,
        "BATCHPILOT_SERVER_IMAGE": "example.invalid/batchpilot-server:bench",
        "BATCHPILOT_METRICS_URLS": urls,
        "BATCHPILOT_ADMIN_URLS": urls,
        "PYTHONUNBUFFERED": "1",
    }
    argv = [sys.executable, "-m", "batchpilot", "operator", "-n", namespace, "--standalone"]
    argv += ["--log-format", "json", "--liveness", liveness]
    return _spawn(argv, env, log)


def wait_http_ok(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited ({proc.returncode}) before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def http_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


class ConnectionWatch:
    """Samples the operator's TCP connections every second from start to stop: every
    remote address it ever had, and those that were not loopback (kwok's fake pod IPs in
    10.244.0.0/16 would be one)."""

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)
        self.remotes: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ConnectionWatch:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(CONNECTION_SAMPLE_SECONDS):
            try:
                connections = self.process.net_connections(kind="inet")
            except psutil.Error:
                return  # the operator has exited: nothing more to see
            self.remotes |= {c.raddr.ip for c in connections if c.raddr}
            self.samples += 1

    @property
    def offenders(self) -> list[str]:
        return non_loopback(self.remotes)
