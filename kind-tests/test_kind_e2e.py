"""End to end on a real kind cluster: images, CRD, operator, an InferenceService on the
bundled model, Ready, and one OpenAI completion through a port-forward.

Runs wherever Docker (with an engine) and kind are available; skips with the reason
elsewhere. See kind-tests/README.md for what it does and the environment knobs:

    BATCHPILOT_KIND_OPERATOR      deployment (default: the operator image in the cluster)
                                  or local (`batchpilot operator` here, on the kubeconfig)
    BATCHPILOT_KIND_SKIP_BUILD=1  use the images already built (make image-server ...)
    BATCHPILOT_KIND_SERVER_IMAGE / BATCHPILOT_KIND_OPERATOR_IMAGE   image names
    BATCHPILOT_KIND_KEEP=1        keep the cluster afterwards (and reuse an existing one)
    BATCHPILOT_KIND_READY_TIMEOUT seconds to wait for Ready (default 900)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.kind

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
CLUSTER = "batchpilot-e2e"
SERVER_IMAGE = os.environ.get("BATCHPILOT_KIND_SERVER_IMAGE", "batchpilot-server:e2e")
OPERATOR_IMAGE = os.environ.get("BATCHPILOT_KIND_OPERATOR_IMAGE", "batchpilot-operator:e2e")
OPERATOR_MODE = os.environ.get("BATCHPILOT_KIND_OPERATOR", "deployment")
KEEP = os.environ.get("BATCHPILOT_KIND_KEEP", "") not in ("", "0")
READY_TIMEOUT = float(os.environ.get("BATCHPILOT_KIND_READY_TIMEOUT", "900"))
OPERATOR_NAMESPACE = "batchpilot-system"
SERVICE = "smol"
SERVER_PORT = 8000
# Loopback only: never send these requests through a proxy.
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def kind_skip_reason() -> str | None:
    prefix = "kind e2e needs a Docker engine and the kind binary; "
    if shutil.which("docker") is None:
        return prefix + "docker is not on PATH"
    try:
        info = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        return prefix + "`docker info` timed out"
    if info.returncode != 0:
        detail = (info.stderr or info.stdout).strip().splitlines()
        return prefix + f"`docker info` failed: {detail[-1] if detail else info.returncode}"
    if shutil.which("kind") is None:
        return prefix + "kind is not on PATH (https://kind.sigs.k8s.io/docs/user/quick-start/)"
    if shutil.which("kubectl") is None:
        return prefix + "found both, but kubectl is not on PATH"
    if OPERATOR_MODE not in ("deployment", "local"):
        return (
            prefix + f"BATCHPILOT_KIND_OPERATOR must be deployment or local, not {OPERATOR_MODE!r}"
        )
    return None


def run(*cmd: str, env: dict | None = None, input: str | None = None, timeout: float = 600):
    """Run a command from the repo root; raise with its output when it fails."""
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, input=input, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


class Kind:
    def __init__(self, workdir: Path):
        self.kubeconfig = workdir / "kubeconfig"
        self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        self.workdir = workdir

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120):
        return run("kubectl", *args, env=self.env, input=input, timeout=timeout)

    def apply(self, *objects: dict) -> None:
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}),
        )

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)


@pytest.fixture(scope="module")
def kind(tmp_path_factory) -> Iterator[Kind]:
    reason = kind_skip_reason()
    if reason:
        pytest.skip(reason)
    k = Kind(tmp_path_factory.mktemp("kind"))
    existing = run("kind", "get", "clusters").stdout.split()
    created = False
    if CLUSTER in existing and KEEP:
        k.kubeconfig.write_text(run("kind", "get", "kubeconfig", "--name", CLUSTER).stdout)
    else:
        if CLUSTER in existing:
            run("kind", "delete", "cluster", "--name", CLUSTER)
        run(
            "kind",
            "create",
            "cluster",
            "--name",
            CLUSTER,
            "--config",
            str(HERE / "kind-config.yaml"),
            "--kubeconfig",
            str(k.kubeconfig),
            "--wait",
            "180s",
            timeout=600,
        )
        created = True
    try:
        images = [("server/Dockerfile", SERVER_IMAGE)]
        if OPERATOR_MODE == "deployment":
            images.append(("operator/Dockerfile", OPERATOR_IMAGE))
        for dockerfile, image in images:
            if os.environ.get("BATCHPILOT_KIND_SKIP_BUILD", "") in ("", "0"):
                run("docker", "build", "-f", dockerfile, "-t", image, ".", timeout=3600)
            run("kind", "load", "docker-image", image, "--name", CLUSTER, timeout=900)
        # Server-side apply: the CRD is too large for the last-applied annotation.
        k.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        k.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/inferenceservices.batchpilot.dev",
        )
        yield k
    finally:
        if created and not KEEP:
            subprocess.run(["kind", "delete", "cluster", "--name", CLUSTER], capture_output=True)


@pytest.fixture(scope="module")
def namespace(kind: Kind) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    kind.kubectl("create", "namespace", name)
    yield name
    if not KEEP:
        kind.kubectl("delete", "namespace", name, "--wait=false")


def operator_objects() -> list[dict]:
    """The operator as a Deployment. Throwaway cluster: its ServiceAccount is cluster-admin."""
    labels = {"app.kubernetes.io/name": "batchpilot-operator"}
    meta = {"name": "batchpilot-operator", "namespace": OPERATOR_NAMESPACE, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "batchpilot-operator-e2e", "labels": labels},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "cluster-admin",
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": "batchpilot-operator",
                    "namespace": OPERATOR_NAMESPACE,
                }
            ],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": "batchpilot-operator",
                        "containers": [
                            {
                                "name": "operator",
                                "image": OPERATOR_IMAGE,
                                "imagePullPolicy": "IfNotPresent",
                                "args": [
                                    "--all-namespaces",
                                    "--standalone",
                                    "--server-image",
                                    SERVER_IMAGE,
                                    "--log-format",
                                    "plain",
                                    "--liveness",
                                    "http://0.0.0.0:8080/healthz",
                                ],
                                "livenessProbe": {
                                    "httpGet": {"path": "/healthz", "port": 8080},
                                    "periodSeconds": 10,
                                    "failureThreshold": 6,
                                },
                            }
                        ],
                    },
                },
            },
        },
    ]


@pytest.fixture(scope="module")
def operator(kind: Kind, namespace: str) -> Iterator[str]:
    """Runs the operator; yields a shell command that prints its logs (for diagnostics)."""
    if OPERATOR_MODE == "deployment":
        kind.apply(*operator_objects())
        kind.kubectl(
            "rollout",
            "status",
            "-n",
            OPERATOR_NAMESPACE,
            "deployment/batchpilot-operator",
            "--timeout=300s",
            timeout=320,
        )
        yield f"kubectl logs -n {OPERATOR_NAMESPACE} deployment/batchpilot-operator --tail=200"
        return
    log = kind.workdir / "operator.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchpilot",
                "operator",
                "-n",
                namespace,
                "--standalone",
                "--server-image",
                SERVER_IMAGE,
                "--log-format",
                "plain",
            ],
            cwd=REPO,
            env=kind.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"tail -n 200 {log}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def diagnostics(kind: Kind, namespace: str, operator_logs: str) -> str:
    parts = []
    for cmd in (
        f"kubectl get inferenceservices,deployments,replicasets,pods,services,events -n {namespace} -o wide",
        f"kubectl describe pods -n {namespace}",
        f"kubectl logs -n {namespace} -l app.kubernetes.io/instance={SERVICE} --tail=100 --all-containers",
        operator_logs,
    ):
        proc = subprocess.run(cmd, shell=True, env=kind.env, capture_output=True, text=True)
        parts.append(f"$ {cmd}\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}")
    return "\n".join(parts)


def cpu_sample(namespace: str) -> dict:
    """examples/cpu-bundled.yaml, with requests small enough for a laptop's kind worker."""
    sample = yaml.safe_load((REPO / "examples" / "cpu-bundled.yaml").read_text())
    assert sample["spec"]["model"]["source"] == "bundled"
    sample["metadata"] = {"name": SERVICE, "namespace": namespace}
    sample["spec"]["imagePullPolicy"] = "IfNotPresent"  # the image exists only in kind
    sample["spec"]["resources"] = {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"memory": "4Gi"},
    }
    return sample


@pytest.fixture(scope="module")
def ready_service(kind: Kind, namespace: str, operator: str) -> dict:
    kind.apply(cpu_sample(namespace))
    deadline = time.monotonic() + READY_TIMEOUT
    isvc: dict = {}
    while time.monotonic() < deadline:
        isvc = kind.get("inferenceservice", SERVICE, "-n", namespace)
        conditions = isvc.get("status", {}).get("conditions", [])
        if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            return isvc
        time.sleep(3)
    pytest.fail(
        f"InferenceService {namespace}/{SERVICE} not Ready after {READY_TIMEOUT:.0f}s; "
        f"status: {json.dumps(isvc.get('status'), indent=1)}\n"
        + diagnostics(kind, namespace, operator),
        pytrace=False,
    )


def test_inference_service_becomes_ready_with_owned_children(kind, namespace, ready_service):
    status = ready_service["status"]
    assert status.get("readyReplicas", 0) >= 1, status
    assert status.get("url", "").startswith(f"http://{SERVICE}.{namespace}.svc"), status
    uid = ready_service["metadata"]["uid"]
    for kind_name in ("deployment", "service", "poddisruptionbudget"):
        child = kind.get(kind_name, SERVICE, "-n", namespace)
        owners = child["metadata"].get("ownerReferences", [])
        assert any(o["uid"] == uid and o.get("controller") for o in owners), (kind_name, owners)
    deployment = kind.get("deployment", SERVICE, "-n", namespace)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == SERVER_IMAGE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with LOCAL.open(request, timeout=timeout) as response:  # raises HTTPError unless 2xx
        raw = response.read()
    return json.loads(raw) if raw.strip() else {}


def test_openai_completion_through_port_forward(kind, namespace, operator, ready_service):
    port = free_port()
    forward = subprocess.Popen(
        [
            "kubectl",
            "port-forward",
            "-n",
            namespace,
            f"service/{SERVICE}",
            f"{port}:{SERVER_PORT}",
            "--address",
            "127.0.0.1",
        ],
        env=kind.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                http("GET", f"{base}/ready", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline or forward.poll() is not None:
                    raise
                time.sleep(1)
        models = http("GET", f"{base}/v1/models")
        model = models["data"][0]["id"]
        completion = http(
            "POST",
            f"{base}/v1/completions",
            {
                "model": model,
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "temperature": 0,
            },
        )
    except Exception as e:
        forward.terminate()
        output = forward.communicate(timeout=10)[0]
        pytest.fail(
            f"completion through port-forward failed: {e!r}\nport-forward: {output[-2000:]}\n"
            + diagnostics(kind, namespace, operator),
            pytrace=False,
        )
    finally:
        if forward.poll() is None:
            forward.terminate()
            forward.wait(timeout=10)
    assert completion["object"] == "text_completion"
    assert completion["model"] == model
    assert completion["choices"][0]["text"].strip(), completion
    assert completion["usage"]["completion_tokens"] > 0, completion
