"""The operator against the real loopback control plane (the `k8s` fixture): the CRD as the
API server enforces it, and kopf handlers run with kopf.testing.KopfRunner, one namespace per
test. kwok marks pods Running and Ready; nothing serves on their IPs."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from kubernetes import client

from batchpilot.operator.crd.api import GROUP, PLURAL, VERSION
from batchpilot.operator.kube import Kube, new_api_client
from batchpilot.operator.reconcile import Reconciler
from tests.support.cluster import (
    IMAGE,
    INTERVAL,
    PROCESS_TIMEOUT,
    ROOT,
    Api,
    config,
    install_crds,
    not_found,
    operator,
    start_operator_process,
    stop_process,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="session")
def crds(k8s) -> None:
    """The generated CRDs, installed once and Established."""
    install_crds(k8s)


@pytest.fixture
def api(k8s, namespace, crds) -> Api:
    """This module's own: the CRDs once per session, $KUBECONFIG only with kubeconfig_env."""
    return Api(k8s, namespace)


@pytest.fixture
def kubeconfig_env(k8s, monkeypatch):
    """The operator (kopf's login and our client) finds the cluster through $KUBECONFIG."""
    monkeypatch.setenv("KUBECONFIG", k8s.kubeconfig)
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)


def owner_uid(obj: Any) -> tuple[str, str, bool, bool]:
    (ref,) = obj.metadata.owner_references
    return ref.kind, ref.uid, ref.controller, ref.block_owner_deletion


# --------------------------------------------------------------------------- API server


@pytest.mark.parametrize(
    "spec, needle",
    [
        (
            {"engine": {"maxNumSeqs": 0}},
            "spec.engine.maxNumSeqs: Invalid value: 0: spec.engine.maxNumSeqs in body should be greater than or equal to 1",
        ),
        (
            {"engine": {"maxNumSeqs": 5000}},
            "spec.engine.maxNumSeqs in body should be less than or equal to 4096",
        ),
        (
            {"engine": {"kvCacheDtype": "int4"}},
            'spec.engine.kvCacheDtype: Unsupported value: "int4"',
        ),
        (
            {"engine": {"gpuMemoryUtilization": 1.5}},
            "spec.engine.gpuMemoryUtilization in body should be less than or equal to 0.99",
        ),
        (
            {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
            "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
        ),
        (
            {"tuning": {"maxNumSeqs": {"min": 300, "max": 100}}},
            "tuning.maxNumSeqs.min must be <= tuning.maxNumSeqs.max",
        ),
        (
            {
                "tuning": {"enabled": True, "maxNumSeqs": {"min": 8, "max": 32}},
                "engine": {"maxNumSeqs": 64},
            },
            "engine.maxNumSeqs must lie within tuning.maxNumSeqs.min..max",
        ),
        (
            {
                "engine": {
                    "enableChunkedPrefill": False,
                    "maxModelLen": 8192,
                    "maxNumBatchedTokens": 2048,
                }
            },
            "maxNumBatchedTokens must be >= maxModelLen",
        ),
        ({"model": {"source": "s3://bucket/llama"}}, "spec.model.source in body should match"),
        (
            {"resources": {"limits": {"nvidia.com/gpu": "lots"}}},
            'spec.resources.limits.nvidia.com/gpu: Invalid value: "lots"',
        ),
        (
            {"replicas": "two"},
            'spec.replicas: Invalid value: "string": spec.replicas in body must be of type integer',
        ),
        # Hardening (issue 19): managed flags, their `=` forms and abbreviations; volumes
        # outside the restricted standard's list.
        ({"engine": {"extraArgs": ["--max-num-seqs=8"]}}, "may not set, or abbreviate"),
        ({"engine": {"extraArgs": ["--max-num-seq=99999"]}}, "may not set, or abbreviate"),
        ({"engine": {"extraArgs": ["--seed", "1", "--admin-tok=x"]}}, "spec.engine.extraArgs"),
        ({"engine": {"extraArgs": ["--admin-port", "9"]}}, "may not set, or abbreviate"),
        # LoRA off under the operator's adapters; the adapters it passes in a variable.
        ({"engine": {"extraArgs": ["--no-enable-lora"]}}, "may not set, or abbreviate"),
        ({"engine": {"extraArgs": ["--preload-lora-modules=[]"]}}, "may not set, or abbreviate"),
        (
            {"pod": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
            "spec.pod.volumes: Invalid value",
        ),
        (
            {"pod": {"volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}},
            "hostPath and other node volumes are refused",
        ),
    ],
)
def test_invalid_specs_are_rejected_by_the_api_server(api, spec, needle):
    with pytest.raises(client.ApiException) as e:
        api.create("bad", spec)
    assert e.value.status == 422, e.value.body
    status = json.loads(e.value.body)
    assert status["reason"] == "Invalid"
    assert needle in status["message"], status["message"]


def test_pod_security_fields_do_not_exist_in_spec_pod(api, k8s):
    """Privilege, host namespaces and added capabilities cannot be asked for: spec.pod has
    no such field, so strict field validation (kubectl's default) refuses them, and
    otherwise they are pruned before anything reads them."""
    for pod in (
        {"securityContext": {"privileged": True}},
        {"hostNetwork": True},
        {"hostPID": True, "hostIPC": True},
        {"containerSecurityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}},
    ):
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceService",
            "metadata": {"name": "priv"},
            "spec": {"pod": pod},
        }
        with pytest.raises(client.ApiException) as e:
            api.custom.create_namespaced_custom_object(
                GROUP, VERSION, api.ns, PLURAL, body, field_validation="Strict"
            )
        assert e.value.status == 400, e.value.body
        assert f'unknown field "spec.pod.{next(iter(pod))}"' in json.loads(e.value.body)["message"]
        manifest = {**body, "metadata": {"name": "priv", "namespace": api.ns}}
        proc = k8s.run_kubectl("apply", "-f", "-", input=json.dumps(manifest), check=False)
        assert proc.returncode != 0 and "unknown field" in proc.stderr, proc.stderr
    # Without strict validation the fields are dropped: nothing stored asks for them.
    stored = api.create("priv", {"pod": {"hostNetwork": True}})
    assert "hostNetwork" not in stored["spec"].get("pod", {})
    api.delete("priv")


def test_invalid_name_and_kubectl_message(api, k8s):
    with pytest.raises(client.ApiException) as e:
        api.create("x" * 64, {})
    assert "metadata.name must be a DNS-1035 label" in json.loads(e.value.body)["message"]
    manifest = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": "bad", "namespace": api.ns},
        "spec": {"engine": {"maxNumSeqs": 9999, "kvCacheDtype": "fp4"}},
    }
    proc = k8s.run_kubectl("apply", "-f", "-", input=json.dumps(manifest), check=False)
    assert proc.returncode != 0
    assert "spec.engine.maxNumSeqs" in proc.stderr and "spec.engine.kvCacheDtype" in proc.stderr


def test_defaults_and_examples_are_accepted(api, k8s):
    created = api.create("defaults", {})
    spec = created["spec"]
    assert spec["engine"]["maxNumSeqs"] == 64 and spec["engine"]["kvCacheDtype"] == "auto"
    assert spec["autoscaling"]["maxReplicas"] == 4 and spec["tuning"]["maxNumSeqs"]["max"] == 256
    assert spec["replicas"] == 1 and spec["model"]["source"] == "bundled"
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        proc = k8s.run_kubectl("apply", "--dry-run=server", "-n", api.ns, "-f", str(path))
        assert "created (server dry run)" in proc.stdout, proc.stdout
    api.delete("defaults")  # no operator ran: no finalizer to wait for


# --------------------------------------------------------------------------- the operator


def test_create_children_owners_ready_and_url(api, k8s, kubeconfig_env):
    with operator(api):
        isvc = api.create(
            "chat", {"engine": {"maxNumSeqs": 32}, "resources": {"limits": {"nvidia.com/gpu": 1}}}
        )
        uid = isvc["metadata"]["uid"]
        st = wait_for("Ready=True", lambda: api.ready("chat"), not_yet=not_found)
        assert st["url"] == f"http://chat.{api.ns}.svc.cluster.local:8000"
        assert st["engine"]["maxNumSeqs"] == 32 and st["engine"]["kvCacheDtype"] == "auto"
        assert st["image"] == IMAGE and st["readyReplicas"] == 1 and st["replicas"] == 1
        kids = api.children()
        assert {k: [o.metadata.name for o in v] for k, v in kids.items()} == {
            "Deployment": ["chat"],
            "Service": ["chat"],
            "PodDisruptionBudget": ["chat"],
            "Secret": [api.secret_name("chat")],
            "ConfigMap": ["chat-engine"],
        }
        for objs in kids.values():
            assert owner_uid(objs[0]) == ("InferenceService", uid, True, True)
            assert objs[0].metadata.labels["batchpilot.dev/service"] == "chat"
        # The token is the one derived from the operator's key, in a Secret whose name does
        # not give it away.
        assert api.token("chat") == api.derived_token("chat")
        assert api.secret_name("chat").startswith("chat-admin-")
        assert api.token("chat") not in api.secret_name("chat")
        # The GPU pod landed on the fake GPU node and is Ready.
        (pod,) = api.core.list_namespaced_pod(
            api.ns, label_selector="batchpilot.dev/service=chat"
        ).items
        assert pod.spec.node_name in k8s.node_names and pod.status.phase == "Running"
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
        # Printer columns.
        table = k8s.run_kubectl("get", "bpis", "-n", api.ns).stdout
        assert table.split("\n")[0].split() == [
            "NAME",
            "READY",
            "REPLICAS",
            "MAXNUMSEQS",
            "KV",
            "URL",
            "AGE",
        ]
        assert table.split("\n")[1].split()[:6] == ["chat", "True", "1", "32", "auto", st["url"]]
        # Kopf's finalizer is the named one, for its timer; the children rely on owners.
        assert api.get("chat")["metadata"]["finalizers"] == ["batchpilot.dev/operator"]
        reasons = {e.reason for e in api.core.list_namespaced_event(api.ns).items}
        assert "Applied" in reasons


def test_spec_change_rolls_and_scale_subresource(api, k8s, kubeconfig_env):
    with operator(api):
        api.create("chat", {"engine": {"maxNumSeqs": 32}})
        wait_for("Ready", lambda: api.ready("chat"), not_yet=not_found)
        dep = api.apps.read_namespaced_deployment("chat", api.ns)
        gen, token = dep.metadata.generation, api.token("chat")

        api.patch("chat", {"engine": {"maxNumSeqs": 80, "kvCacheDtype": "fp8"}})
        st = wait_for(
            "the new generation Ready",
            lambda: (s := api.ready("chat")) and s["engine"]["maxNumSeqs"] == 80 and s,
            not_yet=not_found,
        )
        assert st["engine"]["kvCacheDtype"] == "fp8" and st["observedGeneration"] == 2
        dep = api.apps.read_namespaced_deployment("chat", api.ns)
        assert dep.metadata.generation == gen + 1
        args = dep.spec.template.spec.containers[0].args
        assert args[args.index("--max-num-seqs") + 1] == "80"
        rss = api.apps.list_namespaced_replica_set(
            api.ns, label_selector="batchpilot.dev/service=chat"
        ).items
        assert sorted(rs.spec.replicas for rs in rss) == [0, 1]  # rolled: old scaled to 0
        assert api.token("chat") == token

        k8s.run_kubectl("scale", "bpis/chat", "--replicas=3", "-n", api.ns)
        wait_for(
            "3 ready replicas",
            lambda: (s := api.ready("chat")) and s["readyReplicas"] == 3,
            not_yet=not_found,
        )
        assert api.apps.read_namespaced_deployment("chat", api.ns).spec.replicas == 3
        scale = api.custom.get_namespaced_custom_object_scale(
            GROUP, VERSION, api.ns, PLURAL, "chat"
        )
        assert scale["status"]["replicas"] == 3
        assert (
            scale["status"]["selector"]
            == "app.kubernetes.io/name=batchpilot-server,batchpilot.dev/service=chat"
        )


def test_deletion_garbage_collects_the_children(api, kubeconfig_env):
    with operator(api, cleanup=False):
        api.create("chat", {})
        wait_for("Ready", lambda: api.ready("chat"), not_yet=not_found)
        api.delete("chat")
        wait_for(
            "the InferenceService gone",
            lambda: (
                not api.custom.list_namespaced_custom_object(GROUP, VERSION, api.ns, PLURAL)[
                    "items"
                ]
            ),
            timeout=120,
            not_yet=not_found,
        )
        wait_for(
            "children garbage-collected",
            lambda: not any(api.children().values()),
            timeout=120,
            not_yet=not_found,
        )
        wait_for(
            "pods gone", lambda: not api.core.list_namespaced_pod(api.ns).items, not_yet=not_found
        )


def test_drift_is_corrected_within_one_interval(api, k8s, kubeconfig_env):
    with operator(api):
        api.create("chat", {})
        wait_for("Ready", lambda: api.ready("chat"), not_yet=not_found)
        svc_uid = api.core.read_namespaced_service("chat", api.ns).metadata.uid
        limit = INTERVAL + 8  # one interval, plus the API round trips on this small machine

        def restored(what: str, fn: Callable[[], Any]) -> float:
            t0 = time.monotonic()
            wait_for(what, fn, timeout=limit, not_yet=not_found)
            return time.monotonic() - t0

        api.core.delete_namespaced_service("chat", api.ns)
        restored(
            "Service recreated",
            lambda: api.core.read_namespaced_service("chat", api.ns).metadata.uid != svc_uid,
        )

        api.apps.patch_namespaced_deployment_scale("chat", api.ns, {"spec": {"replicas": 4}})
        restored(
            "Deployment replicas restored",
            lambda: api.apps.read_namespaced_deployment("chat", api.ns).spec.replicas == 1,
        )
        k8s.run_kubectl("set", "env", "deployment/chat", "-c", "server", "HACK=1", "-n", api.ns)
        restored(
            "Deployment env restored",
            lambda: (
                not any(
                    e.name == "HACK"
                    for e in api.apps.read_namespaced_deployment("chat", api.ns)
                    .spec.template.spec.containers[0]
                    .env
                )
            ),
        )

        api.policy.patch_namespaced_pod_disruption_budget(
            "chat", api.ns, {"spec": {"maxUnavailable": 5}}
        )
        restored(
            "PDB restored",
            lambda: (
                api.policy.read_namespaced_pod_disruption_budget(
                    "chat", api.ns
                ).spec.max_unavailable
                == 1
            ),
        )

        # Fields added by hand go too (server-side apply alone would keep them).
        api.core.patch_namespaced_service("chat", api.ns, {"spec": {"selector": {"app": "nope"}}})
        restored(
            "Service selector restored",
            lambda: (
                api.core.read_namespaced_service("chat", api.ns).spec.selector
                == {"app.kubernetes.io/name": "batchpilot-server", "batchpilot.dev/service": "chat"}
            ),
        )

        # The Secret is not watched: the timer restores it, with the same (derived) token,
        # so nothing rolls.
        old_token, generation = (
            api.token("chat"),
            api.apps.read_namespaced_deployment("chat", api.ns).metadata.generation,
        )
        api.core.delete_namespaced_secret(api.secret_name("chat"), api.ns)
        took = restored("Secret recreated by the timer", lambda: api.token("chat"))
        assert took <= limit and api.token("chat") == old_token
        dep = api.apps.read_namespaced_deployment("chat", api.ns)
        assert dep.metadata.generation == generation

        api.apps.delete_namespaced_deployment("chat", api.ns)
        restored(
            "Deployment recreated", lambda: api.apps.read_namespaced_deployment("chat", api.ns)
        )
        wait_for("Ready again", lambda: api.ready("chat"), not_yet=not_found)
        assert {k: len(v) for k, v in api.children().items()} == {
            "Deployment": 1,
            "Service": 1,
            "PodDisruptionBudget": 1,
            "Secret": 1,
            "ConfigMap": 1,
        }


def test_operator_only_problems_degrade_without_children(api, kubeconfig_env):
    with operator(api) as runner:
        api.create("weights", {"model": {"source": "pvc://weights/llama"}})
        api.create("args", {"pod": {"env": [{"name": "BATCHPILOT_ADMIN_TOKEN", "value": "x"}]}})
        api.core.create_namespaced_service_account(api.ns, {"metadata": {"name": "powerful"}})
        api.create("account", {"pod": {"serviceAccountName": "powerful"}})
        api.create(
            "affinity",
            {
                "pod": {
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {"matchExpressions": [{"key": "k", "operator": "Bogus"}]}
                                ]
                            }
                        }
                    }
                }
            },
        )
        expect = {
            "weights": ("ModelSourceNotFound", "PersistentVolumeClaim 'weights' not found"),
            "args": ("InvalidSpec", "BATCHPILOT_ADMIN_TOKEN is set by the operator"),
            "account": ("ServiceAccountNotAllowed", "batchpilot.dev/inference-server=allowed"),
            "affinity": ("InvalidSpec", "not a valid selector operator"),
        }
        for name, (reason, needle) in expect.items():
            c = wait_for(
                f"{name} Degraded",
                lambda n=name: (
                    api.condition(n, "Degraded").get("status") == "True"
                    and api.condition(n, "Degraded")
                ),
                not_yet=not_found,
            )
            assert c["reason"] == reason and needle in c["message"], c
            assert api.condition(name, "Ready")["status"] == "False"
        time.sleep(3 * INTERVAL)  # several timer rounds: still nothing built, nothing crashed
        assert not any(api.children().values()), api.children()
        events = api.core.list_namespaced_event(api.ns, field_selector="type=Warning").items
        assert {"ModelSourceNotFound", "InvalidSpec"} <= {e.reason for e in events}
        assert runner._thread.is_alive()

        # The missing claim appears (bound to a volume, so that the pod can be scheduled):
        # the next round builds everything.
        pv = f"weights-{api.ns}"[:63]
        api.core.create_persistent_volume(
            {
                "metadata": {"name": pv},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "hostPath": {"path": "/tmp/weights"},
                    "claimRef": {"namespace": api.ns, "name": "weights"},
                },
            }
        )
        try:
            api.core.create_namespaced_persistent_volume_claim(
                api.ns,
                {
                    "metadata": {"name": "weights"},
                    "spec": {
                        "accessModes": ["ReadOnlyMany"],
                        "storageClassName": "",
                        "volumeName": pv,
                        "resources": {"requests": {"storage": "1Gi"}},
                    },
                },
            )
            wait_for("weights Ready", lambda: api.ready("weights"), not_yet=not_found)
        finally:
            api.core.delete_persistent_volume(pv)
        assert api.condition("weights", "Degraded")["status"] == "False"
        vols = api.apps.read_namespaced_deployment("weights", api.ns).spec.template.spec.volumes
        (model,) = [v for v in vols if v.name == "model"]
        assert model.persistent_volume_claim.claim_name == "weights"
        # A fixed spec converges too; so does a ServiceAccount its owner allows.
        api.patch("args", {"pod": {"env": [{"name": "SEED", "value": "7"}]}})
        wait_for("args Ready", lambda: api.ready("args"), not_yet=not_found)
        api.core.patch_namespaced_service_account(
            "powerful",
            api.ns,
            {"metadata": {"labels": {"batchpilot.dev/inference-server": "allowed"}}},
        )
        wait_for("account Ready", lambda: api.ready("account"), not_yet=not_found)


class CrashBeforeDeployment(Kube):
    """Writes everything up to the Deployment, then 'dies' there (once)."""

    def __init__(self, reached: threading.Event, release: threading.Event):
        super().__init__(new_api_client())
        self.reached, self.release = reached, release

    def create(self, obj: dict, *, dry_run: bool = False) -> dict:
        if obj["kind"] == "Deployment" and not dry_run:
            self.reached.set()
            self.release.wait(60)
            raise RuntimeError("simulated crash before creating the Deployment")
        return super().create(obj, dry_run=dry_run)


def test_operator_restart_mid_reconcile_converges_without_duplicates(api, kubeconfig_env):
    reached, release = threading.Event(), threading.Event()
    crashing = Reconciler(config(), kube=CrashBeforeDeployment(reached, release))
    with operator(api, reconciler=crashing, cleanup=False):
        api.create("chat", {"replicas": 2})
        assert reached.wait(30), "the reconcile never reached the Deployment"
        kids = api.children()
        assert {k: len(v) for k, v in kids.items()} == {
            "Deployment": 0,
            "Service": 1,
            "PodDisruptionBudget": 1,
            "Secret": 1,
            "ConfigMap": 1,
        }
        (secret,) = kids["Secret"]
        token = base64.b64decode(secret.data["token"]).decode()
        threading.Timer(1.0, release.set).start()  # the stuck handler dies as kopf stops
    release.set()

    with operator(api):  # a fresh operator process, in effect
        st = wait_for("Ready after the restart", lambda: api.ready("chat"), not_yet=not_found)
        assert st["readyReplicas"] == 2
        kids = api.children()
        assert {k: len(v) for k, v in kids.items()} == {
            "Deployment": 1,
            "Service": 1,
            "PodDisruptionBudget": 1,
            "Secret": 1,
            "ConfigMap": 1,
        }
        assert api.token("chat") == token  # the same key, the same token: nothing rolls
        dep = kids["Deployment"][0]
        assert dep.metadata.generation == 1  # applied once, never re-rolled
        rss = api.apps.list_namespaced_replica_set(api.ns).items
        assert len(rss) == 1
        time.sleep(2 * INTERVAL)  # timer rounds change nothing
        assert api.apps.read_namespaced_deployment("chat", api.ns).metadata.generation == 1
        assert len(api.core.list_namespaced_pod(api.ns).items) == 2


# --------------------------------------------------------------------------- the CLI


@pytest.fixture
def free_port() -> int:
    from batchpilot.server.bench.server_process import free_port as pick

    return pick()


def test_cli_process_json_logs_liveness_and_standby_failover(api, k8s, tmp_path, free_port):
    """`batchpilot operator` as processes: JSON logs, /healthz, the server image from the
    environment, and --peering: the lower-priority replica stands by, and takes over when
    the active one stops."""
    api.custom.create_namespaced_custom_object(
        "kopf.dev",
        "v1",
        api.ns,
        "kopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "batchpilot"}},
    )
    liveness = f"http://127.0.0.1:{free_port}/healthz"
    active_log, standby_log = tmp_path / "active.log", tmp_path / "standby.log"
    peering = ("--peering", "batchpilot")
    active = start_operator_process(
        k8s, api.ns, *peering, "--priority", "100", "--liveness", liveness, log=active_log
    )
    standby = None

    def peers() -> int:
        obj = api.custom.get_namespaced_custom_object(
            "kopf.dev", "v1", api.ns, "kopfpeerings", "batchpilot"
        )
        return len(obj.get("status") or {})

    try:
        wait_for(
            "liveness endpoint",
            lambda: _get(liveness) == 200,
            timeout=PROCESS_TIMEOUT,
            not_yet=not_found,
        )
        standby = start_operator_process(k8s, api.ns, *peering, "--priority", "10", log=standby_log)
        wait_for(
            "both replicas in the peering",
            lambda: peers() == 2,
            timeout=PROCESS_TIMEOUT,
            not_yet=not_found,
        )
        api.create("chat", {})
        st = wait_for(
            "Ready via the active replica",
            lambda: api.ready("chat"),
            timeout=PROCESS_TIMEOUT,
            not_yet=not_found,
        )
        assert st["image"] == "env/image:1"  # BATCHPILOT_SERVER_IMAGE
        assert "Applied generation" not in standby_log.read_text()

        stop_process(active)  # it leaves the peering on SIGTERM: the standby resumes at once
        wait_for(
            "the standby to take over",
            lambda: "Resuming operations" in standby_log.read_text(),
            timeout=PROCESS_TIMEOUT,
            not_yet=not_found,
        )
        api.patch("chat", {"engine": {"maxNumSeqs": 12}})
        wait_for(
            "generation 2 Ready via the standby",
            lambda: (s := api.ready("chat")) and s["engine"]["maxNumSeqs"] == 12,
            timeout=PROCESS_TIMEOUT,
            not_yet=not_found,
        )
        api.delete("chat")
        wait_for(
            "deleted",
            lambda: (
                not api.custom.list_namespaced_custom_object(GROUP, VERSION, api.ns, PLURAL)[
                    "items"
                ]
            ),
            timeout=PROCESS_TIMEOUT,
            not_yet=not_found,
        )
    except AssertionError as e:
        logs = [
            f"--- {p.name}\n{p.read_text()[-4000:]}"
            for p in (active_log, standby_log)
            if p.exists()
        ]
        raise AssertionError(f"{e}\n" + "\n".join(logs)) from None
    finally:
        stop_process(active)
        if standby is not None:
            stop_process(standby)
    for log, generation in ((active_log, 1), (standby_log, 2)):
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
        assert lines and all({"message", "severity", "timestamp"} <= set(x) for x in lines)
        applied = [x["message"] for x in lines if x["message"].startswith("Applied generation")]
        assert applied and all(m.startswith(f"Applied generation {generation}") for m in applied), (
            applied
        )
        assert all(
            x["object"]["kind"] == "InferenceService" for x in lines if "Applied" in x["message"]
        )


def _get(url: str) -> int:
    handler = urllib.request.ProxyHandler({})  # loopback: never through a proxy
    try:
        with urllib.request.build_opener(handler).open(url, timeout=2) as resp:
            return resp.status
    except OSError:
        return 0


def test_operator_runs_with_only_its_rbac_rules(api, k8s, tmp_path, monkeypatch):
    """operator/rbac.py's rules are enough: the operator, as a ServiceAccount bound to them,
    builds, reports, corrects drift and degrades, and is never refused."""
    from batchpilot.operator.rbac import cluster_role

    rbac = client.RbacAuthorizationV1Api(k8s.api)
    role = f"batchpilot-operator-{api.ns}"[:63]
    api.core.create_namespaced_service_account(api.ns, {"metadata": {"name": "operator"}})
    rbac.create_cluster_role(cluster_role(role))
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": role},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": api.ns}],
        }
    )
    try:
        token = api.core.create_namespaced_service_account_token(
            "operator", api.ns, {"spec": {"audiences": [], "expirationSeconds": 3600}}
        ).status.token
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "op",
                    "clusters": [
                        {
                            "name": "c",
                            "cluster": {
                                "server": k8s.server,
                                "certificate-authority": str(k8s.workdir / "pki" / "ca.crt"),
                            },
                        }
                    ],
                    "users": [{"name": "op", "user": {"token": token}}],
                    "contexts": [{"name": "op", "context": {"cluster": "c", "user": "op"}}],
                }
            )
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
            monkeypatch.delenv(var, raising=False)
        with operator(api) as runner:
            api.create("chat", {})
            api.create("weights", {"model": {"source": "pvc://weights/m"}})
            # The model cache's claim and fill Job: created (no volume binds: it stays Filling).
            api.create("cached", {"model": {"cache": {"claimName": "models"}}})
            wait_for("Ready as the ServiceAccount", lambda: api.ready("chat"), not_yet=not_found)
            wait_for(
                "a fill Job as the ServiceAccount",
                lambda: "Job" in api.condition("cached", "ModelCacheReady").get("message", ""),
                not_yet=not_found,
            )
            assert api.core.read_namespaced_persistent_volume_claim("models", api.ns)
            wait_for(
                "Degraded as the ServiceAccount",
                lambda: api.condition("weights", "Degraded").get("reason") == "ModelSourceNotFound",
                not_yet=not_found,
            )
            api.core.delete_namespaced_secret(api.secret_name("chat"), api.ns)
            wait_for(
                "Secret restored",
                lambda: api.token("chat"),
                timeout=INTERVAL + 8,
                not_yet=not_found,
            )
            wait_for(
                "an event posted",
                lambda: any(
                    e.reason == "Applied" for e in api.core.list_namespaced_event(api.ns).items
                ),
                not_yet=not_found,
            )
        output = runner.output.lower()
        assert "applied generation 1" in output  # the log is really captured
        assert "forbidden" not in output and " 403" not in output, runner.output[-3000:]
    finally:
        rbac.delete_cluster_role_binding(role)
        rbac.delete_cluster_role(role)
