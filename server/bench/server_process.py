"""Start `batchpilot serve` as a child process on 127.0.0.1 and wait until /ready."""

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

LAUNCH = "import sys; from batchpilot.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(serve_args: list[str], log_path: Path, ready_timeout_s: float = 300.0):
    """Yields the base URL; the server's output goes to log_path, quoted on failure."""
    port = free_port()
    argv = [sys.executable, "-c", LAUNCH, "serve", "--host", "127.0.0.1", "--port", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*argv, *serve_args], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log_path, ready_timeout_s)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f}s:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
