"""batchpilot pods as an InferencePool backend, checked by a real consumer (issue 21): the
Gateway API Inference Extension's own endpoint picker (EPP, v1.5.0, built from its Go module
by kind-tests/gie/build.sh) runs in the cluster against the InferencePool the operator emits
for a two-replica service; its own log shows it reads both pods' queue and KV-cache metrics,
and while one pod is held busy by long requests, the picks pickclient asks for (as a
gateway's Envoy would, over ext_proc) go to the other.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.support.kind import (
    CACHE,
    CLUSTER,
    K8S_VERSION,
    OPERATOR_IMAGE,
    POLL,
    REPO,
    SERVER_PORT,
    SERVICE,
    Kind,
    cpu_sample,
    free_port,
    is_ready,
    run,
    teardown,
    wait_ready,
)
from tests.support.wait import wait_for

sys.path.insert(0, str(REPO / "kind-tests" / "gie"))
import manifests

pytestmark = pytest.mark.kind

GIE_VERSION = re.search(
    r"^GIE_VERSION=(\S+)", (REPO / "tests/k8s/versions.env").read_text(), re.M
).group(1)
EPP_IMAGE = f"batchpilot-gie-epp:{GIE_VERSION}"
GIE_BIN = CACHE / "gie" / GIE_VERSION / "bin"
POOL_CRD = (
    CACHE / "k8s" / K8S_VERSION / "crds" / f"gie-{GIE_VERSION}"
    / "inference.networking.k8s.io_inferencepools.yaml"
)  # fmt: skip
MODEL = "smollm2-135m-instruct"
PICKS = 20
BUSY_STREAMS = 8

# Runs in a pod: BUSY_STREAMS clients that keep one replica busy with long completions.
BUSY = """
import json, sys, threading, urllib.request
url, model, streams = sys.argv[1], sys.argv[2], int(sys.argv[3])
def loop():
    body = json.dumps({"model": model, "prompt": "Tell me a long story.", "max_tokens": 1500,
                       "ignore_eos": True, "temperature": 0}).encode()
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(
                url + "/v1/completions", body, {"Content-Type": "application/json"}), timeout=900).read()
        except Exception as e:
            print(repr(e), flush=True)
threads = [threading.Thread(target=loop) for _ in range(streams)]
for t in threads: t.start()
for t in threads: t.join()
"""


def gie_missing() -> str | None:
    if not POOL_CRD.is_file():
        return f"GIE's InferencePool CRD is not fetched ({POOL_CRD}): make k8s-bins"
    if not (GIE_BIN / "pickclient").is_file():
        return f"GIE's EPP and pickclient are not built ({GIE_BIN}): make kind-gie"
    if subprocess.run(["docker", "image", "inspect", EPP_IMAGE], capture_output=True).returncode:
        return f"the EPP image {EPP_IMAGE} is not built: make kind-gie"
    return None


@pytest.fixture(scope="module")
def pool_service(kind: Kind, namespace: str, operator, report) -> Iterator[dict]:
    if reason := gie_missing():
        pytest.skip(reason)
    kind.kubectl("apply", "--server-side", "-f", str(POOL_CRD))
    kind.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                 "crd/inferencepools.inference.networking.k8s.io")  # fmt: skip
    run("kind", "load", "docker-image", EPP_IMAGE, "--name", CLUSTER, timeout=600)
    sample = cpu_sample(namespace)
    sample["spec"]["replicas"] = 2
    sample["spec"]["routing"] = {
        "inferencePool": True,
        "endpointPicker": {"name": manifests.epp_name(SERVICE), "port": manifests.GRPC_PORT},
    }
    kind.apply(sample)
    kind.apply(*manifests.epp_objects(namespace, SERVICE, EPP_IMAGE))
    isvc = wait_ready(kind, namespace, report, 2, exact=True)
    try:
        wait_for(
            "the EPP available",
            lambda: kind.get("deployment", manifests.epp_name(SERVICE), "-n", namespace)
            .get("status", {}).get("availableReplicas"),
            300, interval=POLL,
        )  # fmt: skip
    except AssertionError as e:
        report(str(e))
    yield isvc
    teardown(kind, namespace)
    kind.kubectl("delete", "-f", str(POOL_CRD), "--ignore-not-found", "--wait=true")


def server_pods(kind: Kind, namespace: str) -> dict[str, str]:
    """Ready server pods: IP -> name."""
    pods = kind.get("pods", "-n", namespace, "-l", f"batchpilot.dev/service={SERVICE}")["items"]
    return {p["status"]["podIP"]: p["metadata"]["name"] for p in pods if is_ready(p)}


def picks(kind: Kind, namespace: str, count: int) -> list[str]:
    """``count`` picks from the EPP through a port-forward, as pod IPs."""
    port = free_port()
    forward = subprocess.Popen(
        ["kubectl", "port-forward", "-n", namespace, f"service/{manifests.epp_name(SERVICE)}",
         f"{port}:{manifests.GRPC_PORT}", "--address", "127.0.0.1"],
        env={**os.environ, **kind.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        wait_for(
            "the port-forward",
            lambda: "Forwarding from" in (forward.stdout.readline()),
            60,
            interval=POLL,
        )
        out = subprocess.run(
            [str(GIE_BIN / "pickclient"), "--addr", f"127.0.0.1:{port}", "--model", MODEL,
             "--prompt", "The capital of France is", "--count", str(count)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        forward.terminate()
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and len(lines) == count, (out.stdout, out.stderr)
    return [line["endpoint"].rsplit(":", 1)[0] for line in lines]


def pod_gauge(kind: Kind, namespace: str, pod: str, metric: str) -> float:
    probe = (
        "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/metrics', "
        "timeout=10).read().decode())"
    )
    text = kind.kubectl("exec", "-n", namespace, pod, "--", "python3", "-c", probe).stdout
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(metric + "{"))


def test_the_epp_reads_every_pod_and_its_picks_follow_load(kind, namespace, pool_service, report):
    pods = server_pods(kind, namespace)
    assert len(pods) == 2, pods
    busy_ip, idle_ip = sorted(pods)
    # One replica held busy: long completions sent to its pod directly, not through the pool.
    kind.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "busy", "namespace": namespace},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{
                    "name": "busy", "image": OPERATOR_IMAGE, "imagePullPolicy": "Never",
                    "command": ["python3", "-c", BUSY, f"http://{busy_ip}:{SERVER_PORT}", MODEL,
                                str(BUSY_STREAMS)],
                }],
            },
        }
    )  # fmt: skip
    try:
        wait_for(
            "the busy replica running its long requests",
            lambda: (
                pod_gauge(kind, namespace, pods[busy_ip], "vllm:num_requests_running")
                >= BUSY_STREAMS / 2
            ),
            300,
            interval=3,
        )
    except AssertionError as e:
        report(str(e))
    got = Counter(picks(kind, namespace, PICKS))
    log = kind.kubectl("logs", "-n", namespace, f"deployment/{manifests.epp_name(SERVICE)}",
                       "--tail=-1").stdout  # fmt: skip
    print(f"picks: {dict(got)}; busy {busy_ip}, idle {idle_ip}")
    # The EPP's own view: every pod of the pool with its queue and KV-cache usage.
    seen = [line for line in log.splitlines() if "KVCacheUsagePercent" in line]
    assert seen, log[-4000:]
    for name in pods.values():
        assert any(name in line for line in seen), (name, seen[-3:])
    assert any("WaitingQueueSize" in line for line in seen), seen[-3:]
    # Its picks follow the load: the busy replica gets few of them.
    assert set(got) <= set(pods), got
    if got[busy_ip] > PICKS // 4:
        report(f"the busy replica got {got[busy_ip]} of {PICKS} picks: {dict(got)}\n{log[-4000:]}")
