"""Session fixtures of the kind tier: one cluster and one image load for every file in
kind-tests/ (creating the cluster and loading the 4 GB server image take minutes on a
2-core machine). Each test file installs the operator, runs its InferenceServices and
tears them down itself, so the files stay independent of each other's order."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.kind import (
    CLUSTER,
    ENV_PATH,
    KEEP,
    KIND_TESTS,
    NODE_IMAGE,
    OPERATOR_IMAGE,
    SERVER_IMAGE,
    SKIP_BUILD,
    Kind,
    build_mode,
    diagnostics,
    install_operator,
    kind_skip_reason,
    run,
)


@pytest.fixture(scope="session")
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
    run("bash", str(KIND_TESTS / "cluster.sh"), "create", CLUSTER, env=env, timeout=3600)
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


@pytest.fixture(scope="session")
def images(kind: Kind) -> None:
    if not SKIP_BUILD:
        if build_mode() == "local":
            env = {"SERVER_IMAGE": SERVER_IMAGE, "OPERATOR_IMAGE": OPERATOR_IMAGE}
            run("bash", str(KIND_TESTS / "images.sh"), env=env, timeout=5400)
        else:
            for dockerfile, image in (
                ("server/Dockerfile", SERVER_IMAGE),
                ("operator/Dockerfile", OPERATOR_IMAGE),
            ):
                run("docker", "build", "-f", dockerfile, "-t", image, ".", timeout=5400)
    for image in (SERVER_IMAGE, OPERATOR_IMAGE):
        run("kind", "load", "docker-image", image, "--name", CLUSTER, timeout=1800)


# Per test file: its own operator install and namespace, so the files stay independent.
@pytest.fixture(scope="module")
def operator(kind: Kind, images) -> Iterator[None]:
    """helm install: the operator in-cluster with the chart's own (least-privilege) RBAC."""
    install_operator(kind)
    yield


@pytest.fixture(scope="module")
def namespace(kind: Kind, request: pytest.FixtureRequest) -> str:
    """test_kind_e2e.py -> e2e-<random>, test_kind_faults.py -> faults-<random>."""
    prefix = Path(request.module.__file__).stem.removeprefix("test_kind_")
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    kind.kubectl("create", "namespace", name)
    return name


@pytest.fixture(scope="module")
def report(kind: Kind, namespace: str) -> Callable[[str], None]:
    """pytest.fail with the namespace's diagnostics (pods, events, logs) appended."""

    def fail(message: str) -> None:
        pytest.fail(f"{message}\n{diagnostics(kind, namespace)}", pytrace=False)

    return fail
