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
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.kind import (
    PLURAL,
    POLL,
    REPO,
    SERVER_IMAGE,
    SERVER_PORT,
    SERVICE,
    Kind,
    cpu_sample,
    free_port,
    patch_spec,
    rollout_done,
    teardown,
    wait_ready,
)
from tests.support.kind_tuning import node_port as support_node_port
from tests.support.kind_tuning import pod_max_num_seqs
from tests.support.wait import wait_for

pytestmark = pytest.mark.kind

ROLL_PROMPTS = 30


@pytest.fixture(scope="module")
def ready_service(kind: Kind, namespace: str, operator, report) -> Iterator[dict]:
    kind.apply(cpu_sample(namespace))
    yield wait_ready(kind, namespace, report)
    teardown(kind, namespace)


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


# --- the closed loop (operator/loop/turn.py driven by the operator's kopf timers)


def closed_loop_wired() -> bool:
    return any(
        "run_once" in p.read_text() and "kopf" in p.read_text()
        for p in (REPO / "operator" / "loop").glob("*.py")
        if p.name != "turn.py"
    )


@pytest.fixture(scope="module")
def node_port(kind: Kind, namespace: str, ready_service) -> str:
    """A NodePort onto the server pods (the test's own Service): load reaches every ready
    replica through kube-proxy, as in-cluster clients would, across rolling updates."""
    selector = {"batchpilot.dev/service": SERVICE}
    return support_node_port(kind, namespace, f"{SERVICE}-e2e-load", selector)


def bench(url: str, out: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    return subprocess.Popen(
        [sys.executable, "-m", "batchpilot", "bench", "serve", "--url", url,
         "--result-dir", str(out.parent), "--result-filename", out.name, "--seed", "1", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_closed_loop_scales_on_queue_and_tunes_the_pods(
    kind, namespace, node_port, tmp_path, report
):
    if not closed_loop_wired():
        pytest.skip("the operator's kopf timers do not run operator/loop/turn.py yet (issue 10)")
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
            # Targets a CPU pod meets: the trials here are about slots, not latency.
            "slo": {"timeToFirstTokenSeconds": 600, "interTokenLatencySeconds": 30},
        },
    )
    # Turning tuning on moves max_num_seqs into the ConfigMap-backed argument: one roll.
    # Load sent during it would be judged by pods about to go.
    wait_for("the roll that turning tuning on starts", lambda: rollout_done(kind, namespace, generation),
             900, interval=3)  # fmt: skip
    out = tmp_path / "load.json"
    # 48 streams against 16 slots: the queue per replica exceeds the target of 2 for as long
    # as the load runs. Far more prompts than the test needs, so that a fast machine cannot
    # finish them before the loop has looked; the load stops once the decisions are applied.
    load = bench(node_port, out, "--num-prompts", "4000", "--request-rate", "inf",
                 "--max-concurrency", "48", "--output-lens", "64")  # fmt: skip

    def replicas() -> int:
        return kind.get("deployment", SERVICE, "-n", namespace)["spec"].get("replicas", 0)

    try:
        wait_for(
            "a scale-up to 2 replicas on queue length", lambda: replicas() >= 2, 420, interval=POLL
        )

        def tuning() -> dict:
            return kind.get(PLURAL, SERVICE, "-n", namespace).get("status", {}).get("tuning") or {}

        wait_for(
            "a tuning decision in status.tuning",
            lambda: tuning().get("maxNumSeqs"),
            420,
            interval=POLL,
        )
        # A canary runs its own value until its verdict: every pod runs what status says
        # is in force once no trial is on.
        wait_for(
            "no trial on, and every pod on status.tuning.maxNumSeqs",
            lambda: (
                not (t := tuning()).get("experiment")
                and (v := pod_max_num_seqs(kind, namespace))
                and all(x == float(t["maxNumSeqs"]) for x in v.values())
            ),
            600,
            interval=POLL,
        )
    except AssertionError as e:
        load.kill()
        report(str(e))
    # The decisions are made and applied: stop the load (on a busy 2-core machine the tuned-down
    # CPU pods would take many minutes to drain it) and expect the scale back down.
    load.terminate()
    load.communicate(timeout=60)
    try:
        wait_for("the scale back down to 1 replica", lambda: replicas() == 1, 600, interval=POLL)
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
        wait_for("the fp8 rollout", rolled, 900, interval=3)
        wait_for(
            "status.engine.kvCacheDtype == fp8",
            lambda: (kind.get(PLURAL, SERVICE, "-n", namespace)["status"].get("engine") or {}).get(
                "kvCacheDtype"
            ) == "fp8",
            120, interval=POLL,
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
