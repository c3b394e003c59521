"""A real `batchpilot serve` process on 127.0.0.1, as the server, activator and cluster
tests drive it: started on free ports, ready when /ready answers, stopped with SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from batchpilot.server.bench.server_process import free_port

REPO = Path(__file__).resolve().parents[2]
BATCHPILOT = str(Path(sys.executable).with_name("batchpilot"))
READY_TIMEOUT = 180.0  # the machine is shared; a tiny model loads in seconds when idle

# Small enough to load fast; the tests never need more context.
TINY_FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB",
              "--swap-space", "0.02")  # fmt: skip


@dataclass
class ServerProcess:
    args: list[str]
    log_path: Path
    api_key: str | None = None
    port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        """Where /admin/* answers (with --admin-token): its own port, never the public one."""
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("VLLM_API_KEY", None)
        env.pop("BATCHPILOT_ADMIN_TOKEN", None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- lives as long as the server
        self.process = subprocess.Popen(
            [BATCHPILOT, "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--admin-port", str(self.admin_port), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {READY_TIMEOUT} s:\n{self.log()}")

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none",
                             max_retries=0, **kwargs)  # fmt: skip

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none",
                                  max_retries=0, **kwargs)  # fmt: skip

    def http(self, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """sample name{labels} -> value, from /metrics parsed by prometheus_client."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}"] = s.value
        return samples

    def metric(self, name: str, **labels) -> float:
        """The value of the one sample `name` whose labels include `labels`."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and labels.items() <= s.labels.items():
                    return s.value
        raise KeyError(name)
