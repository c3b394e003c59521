"""The operator against the loopback control plane (the `k8s` fixture, tests/k8s/): the
InferenceService client `Api`, the operator run in-process with kopf.testing.KopfRunner,
plain (`operator`) or with its closed loop fed by real servers on 127.0.0.1
(`loop_operator`, `server`, `start`). kwok's pods serve nothing and their IPs are fake, so
the loop reads servers outside the cluster that stand for the pods."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from kopf.testing import KopfRunner
from kubernetes import client

from batchpilot.operator.children.meta import MANAGED_SELECTOR, Owner
from batchpilot.operator.children.secret import admin_token
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.crd.api import GROUP, PLURAL, VERSION
from batchpilot.operator.handlers import make_registry
from batchpilot.operator.reconcile import Reconciler
from batchpilot.server.bench.server_process import free_port
from tests.support.servers import TINY_FLAGS, ServerProcess
from tests.support.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "example.invalid/batchpilot-server:test"
INTERVAL = 2.0  # the reconcile interval the tests run the operator with
ADMIN_KEY = "cluster-test-admin-key-7c41-0123456789"  # what the chart's Secret gives the operator
MODEL = "tiny"
LOOP_TIMEOUT = 180  # decisions need a window of observation (20 s) on a shared 2-core machine


def not_found(e: Exception) -> bool:
    """For wait_for's not_yet: a 404 is an object not made yet (or gone already)."""
    return isinstance(e, client.ApiException) and e.status == 404


def install_crds(k8s) -> None:
    """The generated CRDs, applied and Established."""
    k8s.run_kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    k8s.run_kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")


def config(**kw) -> OperatorConfig:
    return OperatorConfig(
        server_image=IMAGE,
        reconcile_interval=INTERVAL,
        resync_interval=INTERVAL,  # drift in the kinds not watched, too, within the tests' waits
        admin_key=ADMIN_KEY,
        **kw,
    )


class Api:
    """Typed clients plus helpers for one namespace."""

    def __init__(self, k8s, namespace: str):
        self.k8s, self.ns = k8s, namespace
        self.core = client.CoreV1Api(k8s.api)
        self.apps = client.AppsV1Api(k8s.api)
        self.policy = client.PolicyV1Api(k8s.api)
        self.custom = client.CustomObjectsApi(k8s.api)

    def create(self, name: str, spec: dict, *, retry_404: bool = True) -> dict:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": spec,
        }
        deadline = time.monotonic() + 15
        while True:  # the CRD's REST mapping can lag Established by a moment
            try:
                return self.custom.create_namespaced_custom_object(
                    GROUP, VERSION, self.ns, PLURAL, body
                )
            except client.ApiException as e:
                if e.status != 404 or not retry_404 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def get(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def patch(self, name: str, spec: dict) -> dict:
        return self.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            self.ns,
            PLURAL,
            name,
            {"spec": spec},
            _content_type="application/merge-patch+json",
        )

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def condition(self, name: str, type_: str) -> dict:
        for c in self.get(name).get("status", {}).get("conditions", []):
            if c["type"] == type_:
                return c
        return {}

    def ready(self, name: str) -> dict | None:
        st = self.get(name).get("status", {})
        c = {c["type"]: c for c in st.get("conditions", [])}
        done = (
            c.get("Ready", {}).get("status") == "True"
            and c.get("Progressing", {}).get("status") == "False"
            and st.get("observedGeneration") == self.get(name)["metadata"]["generation"]
        )
        return st if done else None

    def children(self) -> dict[str, list]:
        """Everything the operator manages in the namespace, by kind."""
        sel = MANAGED_SELECTOR
        return {
            "Deployment": self.apps.list_namespaced_deployment(self.ns, label_selector=sel).items,
            "Service": self.core.list_namespaced_service(self.ns, label_selector=sel).items,
            "PodDisruptionBudget": self.policy.list_namespaced_pod_disruption_budget(
                self.ns, label_selector=sel
            ).items,
            "Secret": self.core.list_namespaced_secret(self.ns, label_selector=sel).items,
            "ConfigMap": self.core.list_namespaced_config_map(self.ns, label_selector=sel).items,
        }

    def secret_name(self, name: str) -> str:
        """The admin token's Secret, as the pods' environment names it."""
        dep = self.apps.read_namespaced_deployment(name, self.ns)
        env = {e.name: e for e in dep.spec.template.spec.containers[0].env}
        return env["BATCHPILOT_ADMIN_TOKEN"].value_from.secret_key_ref.name

    def token(self, name: str) -> str:
        secret = self.core.read_namespaced_secret(self.secret_name(name), self.ns)
        return base64.b64decode(secret.data["token"]).decode()

    def derived_token(self, name: str) -> str:
        uid = self.get(name)["metadata"]["uid"]
        return admin_token(ADMIN_KEY.encode(), Owner(name, self.ns, uid))

    def events(self, name: str) -> dict[str, str]:
        """reason -> message of the Events on the InferenceService."""
        return {
            e.reason: e.message
            for e in self.core.list_namespaced_event(self.ns).items
            if e.involved_object.kind == "InferenceService" and e.involved_object.name == name
        }


def _delete_all(api: Api) -> None:
    """Delete every InferenceService while the operator runs, so that kopf releases its
    finalizer, and wait until they are gone."""
    for item in api.custom.list_namespaced_custom_object(GROUP, VERSION, api.ns, PLURAL)["items"]:
        with contextlib.suppress(client.ApiException):
            api.delete(item["metadata"]["name"])
    wait_for(
        "InferenceServices to be deleted",
        lambda: (
            not api.custom.list_namespaced_custom_object(GROUP, VERSION, api.ns, PLURAL)["items"]
        ),
        timeout=120,  # kopf releases its finalizer; slow on a contended machine
        not_yet=not_found,
    )


@contextlib.contextmanager
def operator(
    api: Api, reconciler: Reconciler | None = None, cleanup: bool = True
) -> Iterator[KopfRunner]:
    """The operator's handlers on the namespace, without metrics sources."""
    cfg = config()
    registry = make_registry(cfg, reconciler or Reconciler(cfg))
    args = ["run", "--standalone", "--verbose", "-n", api.ns]
    with KopfRunner(args, registry=registry, timeout=60) as runner:
        try:
            yield runner
        finally:
            if cleanup:
                _delete_all(api)
    assert runner.exception is None, runner.output


def server(tiny_path: str, tmp_path: Path, *flags: str) -> ServerProcess:
    """A server, not yet started: its ports are known before its token is."""
    args = ["--model", tiny_path, "--served-model-name", MODEL, *TINY_FLAGS, *flags]
    return ServerProcess(args, tmp_path / f"serve-{free_port()}.log")


def start(server: ServerProcess, api: Api, name: str) -> ServerProcess:
    """Start it with the admin token the operator derives for the InferenceService `name`."""
    # One argument: a base64url token starts with "-" one time in 64, which argparse would
    # read as a flag (a CI run's server exited 2 so).
    server.args += [f"--admin-token={api.derived_token(name)}"]
    return server.start()


@contextlib.contextmanager
def loop_operator(
    api: Api,
    servers: list[ServerProcess],
    liveness: str | None = None,
    urls: list[str] = (),
    activator_service: str | None = None,
) -> Iterator[KopfRunner]:
    """The operator with its closed loop, reading `servers` (or `urls`) as the pods."""
    config = OperatorConfig(
        server_image=IMAGE,
        reconcile_interval=5,
        resync_interval=5,
        loop_interval=2,
        status_interval=2,  # every turn's figures in status: the tests wait on them
        metrics_urls=[s.url for s in servers] or list(urls),
        admin_urls=[s.admin_url for s in servers],
        admin_key=ADMIN_KEY,
        liveness=liveness,
        activator_service=activator_service,
    )
    args = ["run", "--standalone", "--verbose", "-n", api.ns]
    with KopfRunner(args, registry=make_registry(config), timeout=60) as runner:
        try:
            yield runner  # its output is complete once the block has exited
        finally:
            _delete_all(api)
    assert runner.exception is None, runner.output


def start_operator_process(
    k8s, namespace: str, *extra: str, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`python -m batchpilot operator -n NAMESPACE EXTRA...` as its own process group,
    its output in ``log``; ``env`` adds to (or overrides) the environment."""
    env = {
        **k8s.env,
        "BATCHPILOT_SERVER_IMAGE": "env/image:1",
        "BATCHPILOT_RECONCILE_INTERVAL": str(INTERVAL),
        "BATCHPILOT_RESYNC_INTERVAL": str(INTERVAL),
        "BATCHPILOT_ADMIN_KEY": ADMIN_KEY,  # one key for both replicas, as the chart gives
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    argv = [sys.executable, "-m", "batchpilot", "operator", "-n", namespace, *extra]
    return subprocess.Popen(
        argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


# Two operator processes start, peer and hand over on a machine that the rest of the suite
# keeps busy: 17 s alone, but a 60 s wait for one step failed once in a full CI run.
PROCESS_TIMEOUT = 180


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextlib.contextmanager
def load(server: ServerProcess, workers: int, max_tokens: int) -> Iterator[None]:
    """Closed-loop clients, each sending the next completion when the last one ends."""
    stop = threading.Event()

    def work() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    http.post("/v1/completions", json={
                        "model": MODEL, "prompt": "Count slowly: one two three",
                        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                    })  # fmt: skip

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(150)
