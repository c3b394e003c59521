"""End to end on a real kind cluster: the images built without a registry, `helm install` of
the chart (the operator in-cluster with the chart's RBAC), the CPU sample on the bundled
model served by real pods, OpenAI completions through a port-forward, the closed loop
(scale on queue length, tuning reaching the pods), an fp8 KV-cache roll under load with zero
failed requests, and a teardown that leaves nothing behind.

Runs wherever a Docker engine and kind are available; skips with the reason elsewhere. kind
is taken from PATH or from the local toolchain ($BATCHPILOT_CACHE/kind/bin, `make
kind-toolchain`). See kind-tests/README.md for the environment knobs:

    BATCHPILOT_KIND_NODE_IMAGE    a node image to use instead of the local toolchain's
                                  (e.g. kindest/node:v1.35.x where a registry is reachable)
    BATCHPILOT_KIND_BUILD         local (default where debootstrap exists: kind-tests/images.sh,
                                  --network none) or docker (plain `docker build`, needs PyPI)
    BATCHPILOT_KIND_SKIP_BUILD=1  use the images already built
    BATCHPILOT_KIND_SERVER_IMAGE / BATCHPILOT_KIND_OPERATOR_IMAGE   image names
    BATCHPILOT_KIND_KEEP=1        keep the cluster afterwards (and reuse an existing one)
    BATCHPILOT_KIND_READY_TIMEOUT seconds to wait for Ready (default 900)

Traffic goes to 127.0.0.1 (port-forward) and to the kind node's container address on the
local Docker bridge (a NodePort, so load spreads over replicas and survives rolling updates).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.kind

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
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
RELEASE = "batchpilot"
SERVICE = "smol"
SERVER_PORT = 8000
GROUP, VERSION, PLURAL = "batchpilot.dev", "v1alpha1", "inferenceservices"
ROLL_PROMPTS = 30


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


def wait_for(what: str, predicate: Callable[[], object], timeout: float, every: float = 2.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


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


@pytest.fixture(scope="module")
def kind(tmp_path_factory) -> Iterator[Kind]:
    reason = kind_skip_reason()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("kind")
    kubeconfig = workdir / "kubeconfig"
    existing = run("kind", "get", "clusters").stdout.split()
    if CLUSTER in existing and not KEEP:
        run("kind", "delete", "cluster", "--name", CLUSTER, timeout=300)
    env = {"KIND_KUBECONFIG": str(kubeconfig)}
    if NODE_IMAGE:
        env["BATCHPILOT_KIND_NODE_IMAGE"] = NODE_IMAGE
    # Builds the node image first when it is neither in Docker nor cached (cold: ~20 min).
    run("bash", str(HERE / "cluster.sh"), "create", CLUSTER, env=env, timeout=3600)
    k = Kind(kubeconfig, workdir)
    node = k.get("nodes")["items"][0]
    k.node_ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
    try:
        yield k
    finally:
        if not KEEP:
            subprocess.run(
                ["kind", "delete", "cluster", "--name", CLUSTER],
                capture_output=True,
                env={**os.environ, "PATH": ENV_PATH},
                timeout=300,
            )


@pytest.fixture(scope="module")
def images(kind: Kind) -> None:
    if not SKIP_BUILD:
        if build_mode() == "local":
            env = {"SERVER_IMAGE": SERVER_IMAGE, "OPERATOR_IMAGE": OPERATOR_IMAGE}
            run("bash", str(HERE / "images.sh"), env=env, timeout=5400)
        else:
            for dockerfile, image in (
                ("server/Dockerfile", SERVER_IMAGE),
                ("operator/Dockerfile", OPERATOR_IMAGE),
            ):
                run("docker", "build", "-f", dockerfile, "-t", image, ".", timeout=5400)
    for image in (SERVER_IMAGE, OPERATOR_IMAGE):
        run("kind", "load", "docker-image", image, "--name", CLUSTER, timeout=1800)


def image_args(image: str) -> tuple[str, str]:
    repository, _, tag = image.rpartition(":")
    return repository, tag


@pytest.fixture(scope="module")
def operator(kind: Kind, images) -> Iterator[None]:
    """helm install: the operator in-cluster with the chart's own (least-privilege) RBAC."""
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
        "--wait",
        "--timeout",
        "300s",
    )
    kind.helm("test", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--timeout", "300s")
    yield


@pytest.fixture(scope="module")
def namespace(kind: Kind) -> str:
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    kind.kubectl("create", "namespace", name)
    return name


def diagnostics(kind: Kind, namespace: str) -> str:
    parts = [
        kind.sh(f"kubectl get {PLURAL} -n {namespace} -o yaml"),
        kind.sh(f"kubectl get all,pdb,events -n {namespace} -o wide"),
        kind.sh(f"kubectl describe pods -n {namespace}"),
        kind.sh(
            f"kubectl logs -n {namespace} -l batchpilot.dev/service={SERVICE} --tail=80 "
            "--all-containers --prefix"
        ),
        kind.sh(f"kubectl get pods,events -n {OPERATOR_NAMESPACE} -o wide"),
        kind.sh(f"kubectl logs -n {OPERATOR_NAMESPACE} deployment/{RELEASE} --tail=200"),
        kind.sh("kubectl get nodes -o wide; kubectl describe nodes | tail -40"),
    ]
    return "\n".join(parts)


@pytest.fixture(scope="module")
def report(kind: Kind, namespace: str) -> Callable[[str], None]:
    def fail(message: str) -> None:
        pytest.fail(f"{message}\n{diagnostics(kind, namespace)}", pytrace=False)

    return fail


def cpu_sample(namespace: str) -> dict:
    """examples/cpu-bundled.yaml, with requests small enough for a 2-core kind node."""
    sample = yaml.safe_load((REPO / "examples" / "cpu-bundled.yaml").read_text())
    assert sample["spec"]["model"]["source"] == "bundled"
    sample["metadata"] = {"name": SERVICE, "namespace": namespace}
    sample["spec"]["imagePullPolicy"] = "IfNotPresent"  # the image exists only in kind
    sample["spec"]["resources"] = {
        "requests": {"cpu": "200m", "memory": "768Mi"},
        "limits": {"memory": "3Gi"},
    }
    return sample


def is_ready(obj: dict) -> bool:
    conditions = obj.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@pytest.fixture(scope="module")
def ready_service(kind: Kind, namespace: str, operator, report) -> Iterator[dict]:
    kind.apply(cpu_sample(namespace))
    try:
        isvc = wait_for(
            "the InferenceService to become Ready",
            lambda: (o := kind.get(PLURAL, SERVICE, "-n", namespace)) and is_ready(o) and o,
            READY_TIMEOUT,
            every=3,
        )
    except AssertionError as e:
        report(str(e))
    yield isvc
    teardown(kind, namespace)


def teardown(kind: Kind, namespace: str) -> None:
    """Delete the CRs, then helm uninstall; nothing of batchpilot may remain."""
    kind.kubectl("delete", PLURAL, "--all", "-n", namespace, "--wait=true", timeout=300)
    selector = f"batchpilot.dev/service={SERVICE}"
    wait_for(
        "the InferenceService's children to be garbage-collected",
        lambda: not kind.kubectl(
            "get", "deployments,services,pdb,secrets,pods", "-n", namespace, "-l", selector,
            "-o", "name",
        ).stdout.strip(),
        300,
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
        300,
    )  # fmt: skip
    # Helm never deletes crds/: that is the cluster owner's call, made here.
    kind.kubectl("delete", "-f", str(REPO / "charts" / "batchpilot" / "crds"), "--wait=true")
    assert not kind.kubectl("get", "crd", "-o", "name").stdout.count(GROUP)
    kind.kubectl("delete", "namespace", namespace, OPERATOR_NAMESPACE, "--wait=false")


def test_ready_with_owned_children(kind, namespace, ready_service):
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


@pytest.fixture(scope="module")
def forwarded(kind: Kind, namespace: str, ready_service) -> Iterator[str]:
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
    base = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for("the port-forward", lambda: listening() or forward.poll() is not None, 60, 0.5)
    try:
        yield base
    finally:
        forward.terminate()
        forward.wait(timeout=10)


def openai_client(base: str, **kw):
    import httpx
    import openai

    # Loopback / local bridge only: no proxy from the environment.
    http_client = httpx.Client(trust_env=False, timeout=120)
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", http_client=http_client, **kw)


def test_openai_completions_through_port_forward(forwarded, report):
    client = openai_client(forwarded)
    try:
        model = client.models.list().data[0].id
        completion = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
    except Exception as e:
        report(f"completions through the port-forward failed: {e!r}")
    assert completion.choices[0].text.strip(), completion
    assert completion.usage.completion_tokens >= 1
    assert chat.choices[0].message.content, chat


# --- the closed loop (operator/loop.py driven by the operator's kopf timers)


def closed_loop_wired() -> bool:
    return any(
        "run_once" in p.read_text() and "kopf" in p.read_text()
        for p in (REPO / "operator").glob("*.py")
        if p.name != "loop.py"
    )


@pytest.fixture(scope="module")
def node_port(kind: Kind, namespace: str, ready_service) -> str:
    """A NodePort onto the server pods (the test's own Service): load reaches every ready
    replica through kube-proxy, as in-cluster clients would, across rolling updates."""
    kind.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"{SERVICE}-e2e-load", "namespace": namespace},
            "spec": {
                "type": "NodePort",
                "selector": {"batchpilot.dev/service": SERVICE},
                "ports": [{"port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        }
    )
    svc = kind.get("service", f"{SERVICE}-e2e-load", "-n", namespace)
    return f"http://{kind.node_ip}:{svc['spec']['ports'][0]['nodePort']}"


def bench(url: str, out: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    return subprocess.Popen(
        [sys.executable, "-m", "batchpilot", "bench", "serve", "--url", url,
         "--result-dir", str(out.parent), "--result-filename", out.name, "--seed", "1", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def pod_max_num_seqs(kind: Kind, namespace: str) -> dict[str, float]:
    """batchpilot:max_num_seqs as each running server pod reports it on /metrics."""
    pods = kind.get("pods", "-n", namespace, "-l", f"batchpilot.dev/service={SERVICE}")
    values = {}
    probe = (
        "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/metrics', "
        "timeout=10).read().decode())"
    )
    for pod in pods["items"]:
        if pod["metadata"].get("deletionTimestamp") or not is_ready(pod):
            continue
        name = pod["metadata"]["name"]
        try:
            out = kind.kubectl("exec", "-n", namespace, name, "--", "python3", "-c", probe).stdout
        except AssertionError:
            return {}  # a pod going away or busy: ask again
        for line in out.splitlines():
            if line.startswith("batchpilot:max_num_seqs"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def rollout_done(kind: Kind, namespace: str, after_generation: int) -> bool:
    dep = kind.get("deployment", SERVICE, "-n", namespace)
    st, want = dep.get("status", {}), dep["spec"]["replicas"]
    return (
        dep["metadata"]["generation"] > after_generation
        and st.get("observedGeneration", 0) >= dep["metadata"]["generation"]
        and st.get("updatedReplicas", 0) == want
        and st.get("readyReplicas", 0) == want
        and st.get("replicas", 0) == want
    )


def patch_spec(kind: Kind, namespace: str, spec: dict) -> None:
    kind.kubectl(
        "patch", PLURAL, SERVICE, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec})
    )


def test_closed_loop_scales_on_queue_and_tunes_the_pods(
    kind, namespace, node_port, tmp_path, report
):
    if not closed_loop_wired():
        pytest.skip("the operator's kopf timers do not run operator/loop.py yet (issue 10)")
    generation = kind.get("deployment", SERVICE, "-n", namespace)["metadata"]["generation"]
    patch_spec(
        kind,
        namespace,
        {
            "autoscaling": {
                "enabled": True,
                "mode": "builtin",
                "minReplicas": 1,
                "maxReplicas": 2,
                "targetQueueLength": 2,
                "scaleUpStabilizationSeconds": 0,
                "scaleDownStabilizationSeconds": 20,
            },
            "tuning": {"enabled": True, "cooldownSeconds": 10, "maxNumSeqs": {"min": 2, "max": 16}},
        },
    )
    # Turning tuning on moves max_num_seqs into the ConfigMap-backed argument: one roll.
    # Load sent during it would be judged by pods about to go.
    wait_for("the roll that turning tuning on starts", lambda: rollout_done(kind, namespace, generation),
             900, every=3)  # fmt: skip
    out = tmp_path / "load.json"
    # 48 streams against 16 slots: the queue per replica exceeds the target of 2 for as long
    # as the load runs. Far more prompts than the test needs, so that a fast machine cannot
    # finish them before the loop has looked; the load stops once the decisions are applied.
    load = bench(node_port, out, "--num-prompts", "4000", "--request-rate", "inf",
                 "--max-concurrency", "48", "--output-lens", "64")  # fmt: skip

    def replicas() -> int:
        return kind.get("deployment", SERVICE, "-n", namespace)["spec"].get("replicas", 0)

    try:
        wait_for("a scale-up to 2 replicas on queue length", lambda: replicas() >= 2, 420)
        tuning = wait_for(
            "a tuning decision in status.tuning",
            lambda: (
                kind.get(PLURAL, SERVICE, "-n", namespace).get("status", {}).get("tuning") or {}
            ).get("maxNumSeqs"),
            420,
        )
        wait_for(
            f"max_num_seqs={tuning} on the running pods",
            lambda: (
                (v := pod_max_num_seqs(kind, namespace))
                and all(x == float(tuning) for x in v.values())
            ),
            180,
        )
    except AssertionError as e:
        load.kill()
        report(str(e))
    # The decisions are made and applied: stop the load (on a busy 2-core machine the tuned-down
    # CPU pods would take many minutes to drain it) and expect the scale back down.
    load.terminate()
    load.communicate(timeout=60)
    try:
        wait_for("the scale back down to 1 replica", lambda: replicas() == 1, 600)
    except AssertionError as e:
        report(str(e))
    isvc = kind.get(PLURAL, SERVICE, "-n", namespace)
    assert isvc["status"].get("autoscaling"), isvc["status"]


def test_fp8_kv_cache_roll_under_load_drops_nothing(kind, namespace, node_port, tmp_path, report):
    out = tmp_path / "roll.json"
    # Arrivals span the roll (a new pod takes ~30-60 s to load on a busy 2-core machine),
    # light enough that a CPU pod keeps up.
    load = bench(node_port, out, "--num-prompts", str(ROLL_PROMPTS), "--request-rate", "0.25",
                 "--max-concurrency", "4", "--output-lens", "16")  # fmt: skip
    time.sleep(5)  # let the load reach steady state before rolling
    generation = kind.get("deployment", SERVICE, "-n", namespace)["metadata"]["generation"]
    # The closed loop off again (max_num_seqs back to the spec's, one replica), fp8 on: one roll.
    patch_spec(
        kind,
        namespace,
        {
            "engine": {"kvCacheDtype": "fp8"},
            "autoscaling": {"enabled": False},
            "tuning": {"enabled": False},
        },
    )

    def rolled() -> bool:
        dep = kind.get("deployment", SERVICE, "-n", namespace)
        st = dep.get("status", {})
        return (
            dep["metadata"]["generation"] > generation
            and st.get("observedGeneration", 0) >= dep["metadata"]["generation"]
            and st.get("updatedReplicas", 0) == dep["spec"]["replicas"]
            and st.get("readyReplicas", 0) == dep["spec"]["replicas"]
            and st.get("replicas", 0) == dep["spec"]["replicas"]
        )

    try:
        wait_for("the fp8 rollout", rolled, 900, every=3)
        wait_for(
            "status.engine.kvCacheDtype == fp8",
            lambda: (kind.get(PLURAL, SERVICE, "-n", namespace)["status"].get("engine") or {}).get(
                "kvCacheDtype"
            ) == "fp8",
            120,
        )  # fmt: skip
    except AssertionError as e:
        load.kill()
        report(str(e))
    output = load.communicate(timeout=1800)[0]
    result = json.loads(out.read_text()) if out.exists() else {}
    errors = [e for e in result.get("errors", []) if e]
    assert load.returncode == 0 and result.get("failed") == 0, (
        f"requests failed during the fp8 roll: {result.get('failed')} of "
        f"{result.get('completed', 0) + result.get('failed', 0)}; errors: "
        f"{sorted(set(errors))[:5]}\n{output[-2000:]}"
    )
    assert result["completed"] == ROLL_PROMPTS
