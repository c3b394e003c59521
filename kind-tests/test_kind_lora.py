"""LoRA adapters on real pods (issue 22): an adapter added to the InferenceService's
spec.adapters becomes servable on every replica without a restart, and one removed from it
is unloaded from every replica, again without a restart.

Two small PEFT adapters for the bundled SmolLM2 are made on the host (rank 4, q_proj only,
about 0.5 MB each) and put on a claim: the node image runs no storage provisioner, so the
claim binds a static hostPath PersistentVolume whose directory in the kind node is filled
with `docker cp`. The CPU sample, with 2 replicas, starts with spec.adapters [first] (so the
claim is mounted from the first pod on); then "second" is added and "first" removed. After
each change: status.adapters, every pod's own /v1/models and completions on every pod and
through the Service (the official openai client over a port-forward), with each pod's uid
and restart count, the Deployment's generation and the pods' template hash unchanged. The
pods load "first" themselves at start-up (the service's ConfigMap lists spec.adapters), and
the list follows the spec for the replicas made later.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchpilot.server.model.loader import resolve_source
from tests.support.kind import (
    CLUSTER,
    PLURAL,
    POLL,
    SERVER_PORT,
    SERVICE,
    Kind,
    cpu_sample,
    free_port,
    patch_spec,
    run,
    teardown,
    wait_ready,
)
from tests.support.models import make_adapter
from tests.support.wait import wait_for

pytestmark = pytest.mark.kind

CLAIM = "loras"
NODE_DIR = "/var/local/batchpilot-lora-e2e"  # in the kind node; one subdirectory per namespace
REPLICAS = 2
CHANGE_TIMEOUT = 180  # an adapter change to reach every pod (the timer runs every 10 s)
PROMPT = "The capital of France is"
MAX_TOKENS = 16


def source(name: str) -> str:
    return f"pvc://{CLAIM}/{name}"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """first/ and second/: PEFT directories for the bundled model, different seeds."""
    root = tmp_path_factory.mktemp("loras")
    base = resolve_source(None)[0]
    for seed, name in enumerate(("first", "second"), start=1):
        make_adapter(base, root / name, rank=4, seed=seed, modules=("q_proj",))
    return root


def kind_node() -> str:
    return run("kind", "get", "nodes", "--name", CLUSTER).stdout.split()[0]


@pytest.fixture(scope="module")
def claim(kind: Kind, namespace: str, adapter_dir: Path) -> Iterator[str]:
    """The claim `loras`, bound to a hostPath PV holding first/ and second/."""
    node, directory, pv = kind_node(), f"{NODE_DIR}/{namespace}", f"lora-e2e-{namespace}"
    run("docker", "exec", node, "mkdir", "-p", directory)
    run("docker", "cp", f"{adapter_dir}/.", f"{node}:{directory}")
    # docker cp keeps the host's modes; the server runs as a non-root user.
    run("docker", "exec", node, "chmod", "-R", "a+rX", directory)
    kind.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "64Mi"},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "claimRef": {"namespace": namespace, "name": CLAIM},
                "hostPath": {"path": directory, "type": "Directory"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "64Mi"}},
            },
        },
    )
    wait_for(
        f"claim {CLAIM} to bind",
        lambda: kind.get("pvc", CLAIM, "-n", namespace).get("status", {}).get("phase") == "Bound",
        60, interval=POLL,
    )  # fmt: skip
    yield CLAIM
    kind.kubectl("delete", "pv", pv, "--ignore-not-found", "--wait=false")
    subprocess.run(["docker", "exec", node, "rm", "-rf", directory], capture_output=True)
    subprocess.run(["docker", "exec", node, "rmdir", NODE_DIR], capture_output=True)  # if empty


def lora_sample(namespace: str) -> dict:
    sample = cpu_sample(namespace)
    sample["spec"]["replicas"] = REPLICAS
    # Two slots, so "first" and "second" could share a batch; the smallest rank bound that
    # fits rank 4.
    sample["spec"]["engine"].update({"maxLoras": 2, "maxLoraRank": 8})
    sample["spec"]["adapters"] = [{"name": "first", "source": source("first")}]
    return sample


@pytest.fixture(scope="module")
def lora_service(kind: Kind, namespace: str, operator, claim, report) -> Iterator[dict]:
    kind.apply(lora_sample(namespace))
    yield wait_ready(kind, namespace, report, REPLICAS)
    teardown(kind, namespace)


@pytest.fixture(scope="module")
def forwarded(kind: Kind, namespace: str, lora_service) -> Iterator[str]:
    """kubectl port-forward service/smol on 127.0.0.1; yields the base URL."""
    port = free_port()
    forward = subprocess.Popen(
        ["kubectl", "port-forward", "-n", namespace, f"service/{SERVICE}",
         f"{port}:{SERVER_PORT}", "--address", "127.0.0.1"],
        env={**os.environ, **kind.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for("the port-forward", lambda: listening() or forward.poll() is not None, 60, 0.5)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        forward.terminate()
        forward.wait(timeout=10)


def openai_client(base: str):
    import httpx
    import openai

    # Loopback only: no proxy from the environment.
    http_client = httpx.Client(trust_env=False, timeout=120)
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", http_client=http_client)


def greedy(client, model: str) -> str:
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.model == model, completion
    return completion.choices[0].text


# --- each pod, from inside it (kubectl exec): nothing routes between pods

PROBE = """
import json, sys, urllib.request, urllib.error
path, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request("http://127.0.0.1:8000" + path, body.encode() if body else None,
                             {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=120) as r:
        status, text = r.status, r.read().decode()
except urllib.error.HTTPError as e:
    status, text = e.code, e.read().decode()
print(json.dumps({"status": status, "body": text}))
"""


def pod_request(kind: Kind, namespace: str, pod: str, path: str, body: dict | None = None):
    out = kind.kubectl(
        "exec", "-n", namespace, pod, "--", "python3", "-c", PROBE, path,
        json.dumps(body) if body else "",
    ).stdout  # fmt: skip
    answer = json.loads(out.strip().splitlines()[-1])
    return answer["status"], answer["body"]


def server_pods(kind: Kind, namespace: str) -> list[dict]:
    items = kind.get("pods", "-n", namespace, "-l", f"batchpilot.dev/service={SERVICE}")["items"]
    return sorted(items, key=lambda p: p["metadata"]["name"])


def identity(kind: Kind, namespace: str) -> dict:
    """What a restart or a roll would change: each pod's uid, template hash and restart
    counts, and the Deployment's generation."""
    pods = {
        p["metadata"]["name"]: (
            p["metadata"]["uid"],
            p["metadata"]["labels"].get("pod-template-hash"),
            tuple(c["restartCount"] for c in p["status"].get("containerStatuses", [])),
            p["metadata"].get("deletionTimestamp"),
        )
        for p in server_pods(kind, namespace)
    }
    generation = kind.get("deployment", SERVICE, "-n", namespace)["metadata"]["generation"]
    return {"pods": pods, "deployment_generation": generation}


def pod_adapters(kind: Kind, namespace: str, pod: str) -> dict[str, str]:
    """The adapters a pod lists on its /v1/models (id -> root: the adapter's name; the
    public list never shows a path, docs/security.md)."""
    status, body = pod_request(kind, namespace, pod, "/v1/models")
    assert status == 200, (pod, status, body)
    return {m["id"]: m["root"] for m in json.loads(body)["data"] if m.get("parent")}


def status_adapters(kind: Kind, namespace: str) -> dict[str, dict]:
    isvc = kind.get(PLURAL, SERVICE, "-n", namespace)
    return {a["name"]: a for a in isvc.get("status", {}).get("adapters") or []}


def loaded_everywhere(kind: Kind, namespace: str, name: str, pods: list[str]) -> bool:
    entry = status_adapters(kind, namespace).get(name)
    if not entry or entry.get("loaded") != len(pods):
        return False
    states = {r["pod"]: r["state"] for r in entry.get("replicas") or []}
    if states != dict.fromkeys(pods, "Loaded"):
        return False
    return all(name in pod_adapters(kind, namespace, pod) for pod in pods)


def gone_everywhere(kind: Kind, namespace: str, name: str, pods: list[str]) -> bool:
    if name in status_adapters(kind, namespace):
        return False
    return all(name not in pod_adapters(kind, namespace, pod) for pod in pods)


def pod_greedy(kind: Kind, namespace: str, pod: str, model: str) -> tuple[int, str]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, text = pod_request(kind, namespace, pod, "/v1/completions", body)
    return status, (json.loads(text)["choices"][0]["text"] if status == 200 else text)


def test_adapters_added_and_removed_live_on_every_pod(
    kind, namespace, lora_service, forwarded, report
):
    import openai

    client = openai_client(forwarded)
    before = identity(kind, namespace)
    pods = sorted(before["pods"])
    if len(pods) != REPLICAS:
        report(f"expected {REPLICAS} server pods, found {pods}")
    base = next(m.id for m in client.models.list().data if not getattr(m, "parent", None))

    # ---- "first", in the spec from the start: on every pod, mounted from the claim
    try:
        wait_for('"first" loaded on every pod',
                 lambda: loaded_everywhere(kind, namespace, "first", pods), CHANGE_TIMEOUT, interval=POLL)  # fmt: skip
    except AssertionError as e:
        report(str(e))
    for pod in pods:
        assert pod_adapters(kind, namespace, pod) == {"first": "first"}, pod
        # Loaded by the server at start-up, from the ConfigMap's list, before it was Ready:
        # not by the operator's first adapter turn after.
        log = kind.kubectl("logs", "-n", namespace, pod).stdout
        loaded = log.find(f"loaded LoRA adapter first from /models/{CLAIM}/first")
        assert 0 <= loaded < log.find("Ready at "), log[-3000:]
    base_text = greedy(client, base)
    first_text = greedy(client, "first")
    assert first_text.strip(), first_text
    # The same text on every pod as through the Service: greedy, one model per name.
    for pod in pods:
        assert pod_greedy(kind, namespace, pod, "first") == (200, first_text), pod
        assert pod_greedy(kind, namespace, pod, base) == (200, base_text), pod
    metrics = pod_request(kind, namespace, pods[0], "/metrics")[1]
    assert 'vllm:lora_requests_info{max_lora="2"' in metrics, metrics[-2000:]

    # ---- add "second": loaded on every pod, nothing restarted or rolled
    adapters = [{"name": "first", "source": source("first")},
                {"name": "second", "source": source("second")}]  # fmt: skip
    patch_spec(kind, namespace, {"adapters": adapters})
    added = time.monotonic()
    try:
        wait_for('"second" loaded on every pod',
                 lambda: loaded_everywhere(kind, namespace, "second", pods), CHANGE_TIMEOUT, interval=POLL)  # fmt: skip
    except AssertionError as e:
        report(str(e))
    timings = {"add_to_every_pod_s": round(time.monotonic() - added, 1)}
    assert identity(kind, namespace) == before, "adding an adapter restarted or rolled pods"
    second_text = greedy(client, "second")
    for pod in pods:
        assert pod_adapters(kind, namespace, pod) == {"first": "first", "second": "second"}, pod
        assert pod_greedy(kind, namespace, pod, "second") == (200, second_text), pod
    # The adapter applies: its greedy text is not the base model's.
    assert second_text != base_text, (second_text, base_text)
    assert first_text != base_text, (first_text, base_text)

    # ---- remove "first": unloaded from every pod, refused by name, nothing restarted
    patch_spec(kind, namespace, {"adapters": [{"name": "second", "source": source("second")}]})
    removed = time.monotonic()
    try:
        wait_for('"first" unloaded from every pod',
                 lambda: gone_everywhere(kind, namespace, "first", pods), CHANGE_TIMEOUT, interval=POLL)  # fmt: skip
    except AssertionError as e:
        report(str(e))
    timings["remove_from_every_pod_s"] = round(time.monotonic() - removed, 1)
    print(json.dumps(timings))
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
        greedy(client, "first")
    for pod in pods:
        status, body = pod_greedy(kind, namespace, pod, "first")
        assert status in (400, 404), (pod, status, body)
        assert pod_greedy(kind, namespace, pod, "second") == (200, second_text), pod
    assert greedy(client, "second") == second_text
    assert identity(kind, namespace) == before, "removing an adapter restarted or rolled pods"
    assert set(status_adapters(kind, namespace)) == {"second"}
    # What a replica made from now on starts with.
    data = kind.get("configmap", f"{SERVICE}-engine", "-n", namespace)["data"]
    assert json.loads(data["lora-modules"]) == [
        {"name": "second", "path": f"/models/{CLAIM}/second"}
    ]
    events = kind.get("events", "-n", namespace)["items"]
    reasons = {(e["reason"], e["message"]) for e in events}
    assert any(r == "AdapterLoaded" and "second" in m for r, m in reasons), reasons
    assert any(r == "AdapterUnloaded" and "first" in m for r, m in reasons), reasons
