"""What the kind tier's tuning tests share: load from this host through a NodePort
(`batchpilot bench serve`), what the pods report running, and what status.tuning and the
InferenceService's Events say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.support.kind import PLURAL, REPO, SERVER_PORT, SERVICE, Kind, is_ready


def node_port(kind: Kind, namespace: str, name: str, selector: dict[str, str]) -> str:
    """A NodePort Service ``name`` onto the server pods ``selector`` picks; its URL."""
    kind.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "type": "NodePort",
                "selector": selector,
                "ports": [{"port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        }
    )
    svc = kind.get("service", name, "-n", namespace)
    return f"http://{kind.node_ip}:{svc['spec']['ports'][0]['nodePort']}"


def bench(url: str, out: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    # The load's own output goes to a file beside its result: when no verdict comes, its tail
    # says whether the load ran (a CI run once saw 0 ITL observations for 10 minutes).
    with open(out.with_suffix(".log"), "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "batchpilot", "bench", "serve", "--url", url,
             "--result-dir", str(out.parent), "--result-filename", out.name, "--seed", "1",
             *args],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


def start_load(url: str, out: Path, output: int, prompt_repeats: int, streams: int = 0,
               rate: float = 0.0) -> subprocess.Popen:  # fmt: skip
    """``streams`` closed-loop clients, or Poisson arrivals at ``rate`` a second (at most 8
    at once), for as long as the load runs (far more prompts than a test needs; it is
    stopped at the end), each answer ``output`` tokens; its result and log beside ``out``."""
    assert bool(streams) != bool(rate), "streams or rate"
    pace = ["--request-rate", "inf", "--max-concurrency", str(streams)] if streams else [
        "--request-rate", str(rate), "--max-concurrency", "8"]  # fmt: skip
    return bench(url, out, "--num-prompts", "20000", *pace, "--output-lens", str(output),
                 "--prompt-repeats", str(prompt_repeats))  # fmt: skip


def stop_load(load: subprocess.Popen) -> None:
    load.terminate()
    try:
        load.wait(timeout=60)
    except subprocess.TimeoutExpired:
        load.kill()


def answers(url: str) -> bool:
    """Whether the server behind ``url`` answers /health (no proxy, like the load)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def load_logs(tmp_path: Path) -> str:
    """The last lines of every load generator's output."""
    return "\n".join(
        f"--- {log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        for log in sorted(tmp_path.glob("load-*.log"))
    )


def tuning_status(kind: Kind, namespace: str, name: str = SERVICE) -> dict:
    return (kind.get(PLURAL, name, "-n", namespace).get("status") or {}).get("tuning") or {}


def dump(tuning: dict) -> str:
    return "status.tuning:\n" + json.dumps(tuning, indent=1, sort_keys=True)


def server_pods(kind: Kind, namespace: str, name: str = SERVICE) -> list[dict]:
    """The service's Ready server pods that are not going away."""
    pods = kind.get("pods", "-n", namespace, "-l", f"batchpilot.dev/service={name}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and is_ready(p)]


def pod_max_num_seqs(kind: Kind, namespace: str, name: str = SERVICE) -> dict[str, float]:
    """batchpilot:max_num_seqs as each Ready server pod reports it on /metrics, by pod."""
    probe = (
        "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/metrics', "
        "timeout=10).read().decode())"
    )
    values = {}
    for pod in server_pods(kind, namespace, name):
        pod_name = pod["metadata"]["name"]
        try:
            out = kind.kubectl("exec", "-n", namespace, pod_name, "--", "python3", "-c", probe)
        except AssertionError:
            return {}  # a pod going away or too busy to answer: ask again
        for line in out.stdout.splitlines():
            if line.startswith("batchpilot:max_num_seqs"):
                values[pod_name] = float(line.rsplit(" ", 1)[1])
    return values


def events(kind: Kind, namespace: str, reason: str, name: str = SERVICE) -> list[dict]:
    items = kind.get("events", "-n", namespace)["items"]
    return [
        e
        for e in items
        if e.get("reason") == reason
        and e["involvedObject"].get("kind") == "InferenceService"
        and e["involvedObject"].get("name") == name
    ]
