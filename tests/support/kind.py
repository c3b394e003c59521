"""What the kind test files share: the environment knobs, running kind/kubectl/helm, the
``Kind`` handle, the operator's helm install, the CPU sample, waiting for it Ready,
diagnostics and the teardown. The session fixtures built on it (the cluster, the images in
it) are in kind-tests/conftest.py; see kind-tests/README.md for the knobs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import yaml

from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
KIND_TESTS = REPO / "kind-tests"
CLUSTER = "batchpilot-e2e"
CACHE = Path(os.environ.get("BATCHPILOT_CACHE", Path.home() / ".cache" / "batchpilot"))
K8S_VERSION = re.search(
    r"^K8S_VERSION=(\S+)", (REPO / "tests/k8s/versions.env").read_text(), re.M
).group(1)
TOOL_PATH = [CACHE / "kind" / "bin", CACHE / "k8s" / K8S_VERSION / "bin"]
ENV_PATH = os.pathsep.join([*map(str, TOOL_PATH), os.environ.get("PATH", "")])
SERVER_IMAGE = os.environ.get("BATCHPILOT_KIND_SERVER_IMAGE", "batchpilot-server:e2e")
OPERATOR_IMAGE = os.environ.get("BATCHPILOT_KIND_OPERATOR_IMAGE", "batchpilot-operator:e2e")
NODE_IMAGE = os.environ.get("BATCHPILOT_KIND_NODE_IMAGE", "")
KEEP = os.environ.get("BATCHPILOT_KIND_KEEP", "") not in ("", "0")
SKIP_BUILD = os.environ.get("BATCHPILOT_KIND_SKIP_BUILD", "") not in ("", "0")
READY_TIMEOUT = float(os.environ.get("BATCHPILOT_KIND_READY_TIMEOUT", "900"))
OPERATOR_NAMESPACE = "batchpilot-system"
OPERATOR_SELECTOR = (
    "app.kubernetes.io/name=batchpilot-operator,app.kubernetes.io/component=operator"
)
RELEASE = "batchpilot"
SERVICE = "smol"
SERVER_PORT = 8000
GROUP, VERSION, PLURAL = "batchpilot.dev", "v1alpha1", "inferenceservices"
# How often to poll a condition: each check runs kubectl (or curl) against a real cluster.
POLL = 2.0


def which(name: str) -> str | None:
    return shutil.which(name, path=ENV_PATH)


def build_mode() -> str:
    default = "local" if shutil.which("debootstrap") and os.geteuid() == 0 else "docker"
    return os.environ.get("BATCHPILOT_KIND_BUILD", default)


def kind_skip_reason() -> str | None:
    prefix = "kind e2e needs a Docker engine and kind; "
    if shutil.which("docker") is None:
        return prefix + "docker is not on PATH (CI: kind-tests/host-setup.sh installs it)"
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
        return prefix + f"no Docker engine answers: {detail[-1] if detail else info.returncode}"
    if which("kind") is None:
        return prefix + "kind is neither on PATH nor built (`make kind-toolchain`)"
    for tool in ("kubectl", "helm"):
        if which(tool) is None:
            return prefix + f"{tool} is neither on PATH nor built (`make k8s-bins`)"
    if build_mode() not in ("local", "docker"):
        return prefix + "BATCHPILOT_KIND_BUILD must be local or docker"
    return None


def run(*cmd: str, env: dict | None = None, input: str | None = None, timeout: float = 600):
    """Run a command from the repo root; raise with its output when it fails."""
    env = {**os.environ, "PATH": ENV_PATH, **(env or {})}
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, input=input, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


class Kind:
    def __init__(self, kubeconfig: Path, workdir: Path):
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.env = {"KUBECONFIG": str(kubeconfig), "PATH": ENV_PATH}
        self.node_ip = ""

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 180):
        return run("kubectl", *args, env=self.env, input=input, timeout=timeout)

    def helm(self, *args: str, timeout: float = 600):
        return run("helm", *args, env=self.env, timeout=timeout)

    def apply(self, *objects: dict) -> None:
        items = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        self.kubectl("apply", "-f", "-", input=json.dumps(items))

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def sh(self, cmd: str) -> str:
        env = {**os.environ, **self.env}
        proc = subprocess.run(cmd, shell=True, env=env, capture_output=True, text=True)
        return f"$ {cmd}\n{proc.stdout[-8000:]}{proc.stderr[-2000:]}"


def image_args(image: str) -> tuple[str, str]:
    repository, _, tag = image.rpartition(":")
    return repository, tag


def install_operator(kind: Kind) -> None:
    """helm install: the operator in-cluster with the chart's own (least-privilege) RBAC.
    A previous module's teardown may still be deleting the operator's namespace."""
    wait_for(
        f"namespace {OPERATOR_NAMESPACE} from an earlier teardown to be gone",
        lambda: (
            not kind.kubectl(
                "get", "namespace", OPERATOR_NAMESPACE, "--ignore-not-found", "-o", "name"
            ).stdout.strip()
            or kind.get("namespace", OPERATOR_NAMESPACE)["status"].get("phase") != "Terminating"
        ),
        300,
        interval=POLL,
    )
    op_repo, op_tag = image_args(OPERATOR_IMAGE)
    srv_repo, srv_tag = image_args(SERVER_IMAGE)
    kind.helm(
        "upgrade",
        "--install",
        RELEASE,
        str(REPO / "charts" / "batchpilot"),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--set",
        f"image.repository={op_repo}",
        "--set",
        f"image.tag={op_tag}",
        "--set",
        "image.pullPolicy=Never",
        "--set",
        f"serverImage.repository={srv_repo}",
        "--set",
        f"serverImage.tag={srv_tag}",
        "--set",
        "operator.logFormat=plain",
        "--set",
        "operator.reconcileInterval=10",
        "--set",
        "operator.resyncInterval=10",
        # Every loop turn's figures in status: the tests wait on them (the default's held
        # figures: tests/unit/test_operator_api_load.py, benchmarks/operator_scale).
        "--set",
        "operator.statusInterval=5",
        # One replica: the fault tests kill "the operator" and the reports read its log; the
        # chart's two peered replicas are tested in the cluster tier (test_chart.py,
        # test_operator_cluster.py's failover).
        "--set",
        "operator.replicas=1",
        "--wait",
        "--timeout",
        "300s",
    )
    kind.helm("test", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--timeout", "300s")


def diagnostics(kind: Kind, namespace: str, service: str = SERVICE) -> str:
    parts = [
        kind.sh(f"kubectl get {PLURAL} -n {namespace} -o yaml"),
        kind.sh(f"kubectl get all,pdb,events -n {namespace} -o wide"),
        kind.sh(f"kubectl describe pods -n {namespace}"),
        kind.sh(
            f"kubectl logs -n {namespace} -l batchpilot.dev/service={service} --tail=80 "
            "--all-containers --prefix"
        ),
        kind.sh(f"kubectl get pods,events -n {OPERATOR_NAMESPACE} -o wide"),
        kind.sh(f"kubectl logs -n {OPERATOR_NAMESPACE} deployment/{RELEASE} --tail=200"),
        kind.sh("kubectl get nodes -o wide; kubectl describe nodes | tail -40"),
    ]
    return "\n".join(parts)


def cpu_sample(namespace: str, name: str = SERVICE) -> dict:
    """examples/cpu-bundled.yaml, with requests small enough for a 2-core kind node."""
    sample = yaml.safe_load((REPO / "examples" / "cpu-bundled.yaml").read_text())
    assert sample["spec"]["model"]["source"] == "bundled"
    sample["metadata"] = {"name": name, "namespace": namespace}
    sample["spec"]["imagePullPolicy"] = "IfNotPresent"  # the image exists only in kind
    sample["spec"]["resources"] = {
        "requests": {"cpu": "200m", "memory": "768Mi"},
        "limits": {"memory": "3Gi"},
    }
    return sample


def is_ready(obj: dict) -> bool:
    conditions = obj.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def wait_ready(kind: Kind, namespace: str, report, replicas: int = 0, exact: bool = False,
               name: str = SERVICE) -> dict:  # fmt: skip
    """The InferenceService ``name`` once Ready, with at least (or, if exact, exactly)
    `replicas` Ready replicas; report (the fixture: fail with diagnostics) if it is not
    within READY_TIMEOUT."""

    def ready() -> dict | None:
        obj = kind.get(PLURAL, name, "-n", namespace)
        count = (obj.get("status", {}).get("readyReplicas") or 0) if obj else 0
        enough = count == replicas if exact else count >= replicas
        return obj if obj and is_ready(obj) and enough else None

    what = f"the InferenceService {name} to become Ready"
    try:
        return wait_for(
            what + (f" with {replicas} replicas" if replicas else ""),
            ready,
            READY_TIMEOUT,
            interval=3,
        )
    except AssertionError as e:
        report(str(e))
        raise  # not reached: report fails the test


def teardown(kind: Kind, namespace: str) -> None:
    """Delete the CRs, then helm uninstall; nothing of batchpilot may remain."""
    kind.kubectl("delete", PLURAL, "--all", "-n", namespace, "--wait=true", timeout=300)
    selector = "batchpilot.dev/service"  # every InferenceService's
    wait_for(
        "the InferenceServices' children to be garbage-collected",
        lambda: not kind.kubectl(
            "get", "deployments,services,pdb,secrets,pods", "-n", namespace, "-l", selector,
            "-o", "name",
        ).stdout.strip(),
        300, interval=POLL,
    )  # fmt: skip
    kind.helm("uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait")
    release = f"app.kubernetes.io/instance={RELEASE}"
    wait_for(
        "the release's objects to be gone",
        lambda: not (
            kind.kubectl("get", "all,sa,cm,roles,rolebindings", "-n", OPERATOR_NAMESPACE,
                         "-l", release, "-o", "name").stdout.strip()
            or kind.kubectl("get", "clusterroles,clusterrolebindings", "-l", release,
                            "-o", "name").stdout.strip()
        ),
        300, interval=POLL,
    )  # fmt: skip
    # Helm never deletes crds/: that is the cluster owner's call, made here.
    kind.kubectl("delete", "-f", str(REPO / "charts" / "batchpilot" / "crds"), "--wait=true")
    assert not kind.kubectl("get", "crd", "-o", "name").stdout.count(GROUP)
    kind.kubectl("delete", "namespace", namespace, OPERATOR_NAMESPACE, "--wait=false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rollout_done(kind: Kind, namespace: str, after_generation: int, name: str = SERVICE) -> bool:
    dep = kind.get("deployment", name, "-n", namespace)
    st, want = dep.get("status", {}), dep["spec"]["replicas"]
    return (
        dep["metadata"]["generation"] > after_generation
        and st.get("observedGeneration", 0) >= dep["metadata"]["generation"]
        and st.get("updatedReplicas", 0) == want
        and st.get("readyReplicas", 0) == want
        and st.get("replicas", 0) == want
    )


def patch_spec(kind: Kind, namespace: str, spec: dict, name: str = SERVICE) -> None:
    kind.kubectl(
        "patch", PLURAL, name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec})
    )
