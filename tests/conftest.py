"""Shared pytest fixtures.

`k8s` / `namespace`: a real Kubernetes control plane on 127.0.0.1 for tests marked `cluster`
(see docs/testing.md). Any test that uses `k8s` (directly or through `namespace`) is marked
`cluster` automatically, so `pytest -m "not cluster"` never starts or needs it.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.k8s import cluster as k8s_cluster

_kept_logs: list[Path] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "k8s" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.cluster)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    for path in _kept_logs:
        terminalreporter.write_line(f"loopback Kubernetes component logs kept in: {path}")


@pytest.fixture(scope="session")
def k8s(request: pytest.FixtureRequest) -> Iterator[object]:
    """A real Kubernetes control plane on 127.0.0.1, shared by the whole session.

    etcd, kube-apiserver (RBAC on), kube-controller-manager (all controllers, incl. the
    garbage collector), kube-scheduler and kwok, from the binaries that `make k8s-bins`
    builds into $BATCHPILOT_CACHE/k8s/<version>/bin. One fake node, ``kwok-gpu-0``
    (annotated ``kwok.x-k8s.io/node: fake``), advertises cpu 32, memory 256Gi, pods 110 and
    ``nvidia.com/gpu: 8``; kwok marks pods scheduled there Running/Ready (fake pod IPs in
    10.244.0.0/16, nothing listens on them), completes Job pods and finalizes deletions.

    The yielded handle (tests/k8s/cluster.py: ``Cluster``) has a stable interface:

    - ``k8s.kubeconfig``: path (str) of an admin kubeconfig (system:masters client cert)
    - ``k8s.kubectl`` / ``k8s.helm``: paths (str) of the kubectl and helm binaries
    - ``k8s.api``: a ``kubernetes.client.ApiClient`` for that admin
    - ``k8s.server``: the apiserver URL; ``k8s.token``: an admin bearer token
    - ``k8s.env``: environment for subprocesses (KUBECONFIG, private HELM_* dirs)
    - ``k8s.run_kubectl(*args, check=True, input=None)`` and ``k8s.run_helm(*args)``:
      ``subprocess.CompletedProcess[str]``, raising CalledProcessError if check fails
    - ``k8s.node_names``, ``k8s.workdir``, ``k8s.log_dir``

    Fails (does not skip) when the binaries are missing. Logs are kept, and their location
    printed, when start-up or any test fails, or when BATCHPILOT_K8S_KEEP=1.
    """
    keep = os.environ.get("BATCHPILOT_K8S_KEEP", "") not in ("", "0")
    error = None
    try:
        cluster = k8s_cluster.start_cluster(keep=keep)
    except k8s_cluster.BinariesMissing as e:
        error = str(e)
    except k8s_cluster.ClusterError as e:
        error = f"the loopback Kubernetes control plane failed to start: {e}"
    if error:
        pytest.fail(error, pytrace=False)
    try:
        yield cluster
    finally:
        if request.session.testsfailed:
            cluster.keep = True
        cluster.stop()
        if cluster.keep:
            _kept_logs.append(cluster.log_dir)


@pytest.fixture
def namespace(k8s, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (its name) with its `default` ServiceAccount; deleted afterwards."""
    from kubernetes import client

    core = client.CoreV1Api(k8s.api)
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{slug or 't'}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    deadline = time.monotonic() + 30
    while True:
        try:
            core.read_namespaced_service_account("default", name)
            break
        except client.ApiException as e:
            if e.status != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    try:
        yield name
    finally:
        try:
            core.delete_namespace(name, propagation_policy="Background")
        except client.ApiException as e:
            if e.status != 404:
                raise
