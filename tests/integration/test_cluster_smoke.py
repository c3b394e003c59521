"""Smoke tests proving the loopback control plane (the `k8s` fixture) is a real cluster:
scheduling against extended resources, kwok readiness, CRD schema + CEL validation by the
apiserver, RBAC, service-account tokens, and helm."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[1] / "k8s" / "testdata" / "hello"
GPU = "nvidia.com/gpu"


def gpu_container(gpus: int) -> client.V1Container:
    return client.V1Container(
        name="app",
        image="fake-image:0",
        resources=client.V1ResourceRequirements(
            requests={"cpu": "100m", GPU: str(gpus)}, limits={GPU: str(gpus)}
        ),
    )


def test_gpu_deployment_scheduled_on_fake_node_and_ready(k8s, namespace):
    apps, core = client.AppsV1Api(k8s.api), client.CoreV1Api(k8s.api)
    labels = {"app": "gpu"}
    apps.create_namespaced_deployment(
        namespace,
        client.V1Deployment(
            metadata=client.V1ObjectMeta(name="gpu"),
            spec=client.V1DeploymentSpec(
                replicas=3,
                selector=client.V1LabelSelector(match_labels=labels),
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels=labels),
                    spec=client.V1PodSpec(containers=[gpu_container(1)]),
                ),
            ),
        ),
    )

    def available():
        dep = apps.read_namespaced_deployment("gpu", namespace)
        return (dep.status.available_replicas or 0) == dep.spec.replicas

    wait_for("deployment gpu availableReplicas == 3", available, interval=0.25)

    pods = core.list_namespaced_pod(namespace, label_selector="app=gpu").items
    assert len(pods) == 3
    for pod in pods:
        assert pod.spec.node_name in k8s.node_names
        assert pod.status.phase == "Running"
        conds = {c.type: c.status for c in pod.status.conditions}
        assert conds["Ready"] == "True", conds
        assert pod.status.pod_ip and not pod.status.pod_ip.startswith("127.")

    # The scheduler really accounts for the extended resource: 3 + 6 > 8 GPUs on the node.
    core.create_namespaced_pod(
        namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(name="too-many-gpus"),
            spec=client.V1PodSpec(containers=[gpu_container(6)]),
        ),
    )

    def unschedulable():
        pod = core.read_namespaced_pod("too-many-gpus", namespace)
        for c in pod.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False":
                return c
        return None

    cond = wait_for("too-many-gpus to be reported unschedulable", unschedulable, interval=0.25)
    assert cond.reason == "Unschedulable"
    assert f"Insufficient {GPU}" in cond.message

    # Scaling down deletes pods; kwok's pod-delete stage lets them go away (no kubelet).
    apps.patch_namespaced_deployment_scale("gpu", namespace, {"spec": {"replicas": 1}})
    wait_for(
        "pods to scale down to 1",
        lambda: len(core.list_namespaced_pod(namespace, label_selector="app=gpu").items) == 1,
        interval=0.25,
    )


def _crd(group: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["minReplicas", "maxReplicas"],
                                    "properties": {
                                        "minReplicas": {"type": "integer", "minimum": 0},
                                        "maxReplicas": {"type": "integer", "minimum": 1},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.minReplicas <= self.maxReplicas",
                                            "message": "minReplicas must not exceed maxReplicas",
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def test_crd_schema_and_cel_validation(k8s, namespace):
    ext = client.ApiextensionsV1Api(k8s.api)
    custom = client.CustomObjectsApi(k8s.api)
    group = f"smoke{uuid.uuid4().hex[:6]}.batchpilot.test"
    ext.create_custom_resource_definition(_crd(group))
    try:

        def established():
            crd = ext.read_custom_resource_definition(f"widgets.{group}")
            return any(
                c.type == "Established" and c.status == "True"
                for c in (crd.status.conditions or [])
            )

        wait_for("CRD Established", established, interval=0.25)

        def widget(name: str, lo: Any, hi: Any) -> dict[str, Any]:
            return {
                "apiVersion": f"{group}/v1",
                "kind": "Widget",
                "metadata": {"name": name},
                "spec": {"minReplicas": lo, "maxReplicas": hi},
            }

        def create(obj: dict[str, Any]) -> Any:
            # The CRD's REST mapping can lag Established by a moment: retry 404s briefly.
            deadline = time.monotonic() + 15
            while True:
                try:
                    return custom.create_namespaced_custom_object(
                        group, "v1", namespace, "widgets", obj
                    )
                except client.ApiException as e:
                    if e.status != 404 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

        create(widget("good", 1, 3))

        with pytest.raises(client.ApiException) as bad:
            create(widget("bad", 5, 2))
        assert bad.value.status == 422
        status = json.loads(bad.value.body)
        assert status["reason"] == "Invalid"
        assert "minReplicas must not exceed maxReplicas" in status["message"]
        assert status["details"]["causes"][0]["field"] == "spec"

        with pytest.raises(client.ApiException) as wrong_type:
            create(widget("wrong-type", "one", 3))
        assert wrong_type.value.status == 422
        assert "spec.minReplicas" in json.loads(wrong_type.value.body)["message"]

        # kubectl sees the same server-side rejection.
        proc = k8s.run_kubectl(
            "apply", "-n", namespace, "-f", "-", input=json.dumps(widget("bad2", 9, 1)), check=False
        )
        assert proc.returncode != 0
        assert "minReplicas must not exceed maxReplicas" in proc.stderr
    finally:
        ext.delete_custom_resource_definition(f"widgets.{group}")


def test_rbac_role_is_enforced(k8s, namespace):
    core, rbac = client.CoreV1Api(k8s.api), client.RbacAuthorizationV1Api(k8s.api)
    authz = client.AuthorizationV1Api(k8s.api)
    user = f"system:serviceaccount:{namespace}:reader"

    def can_i(verb: str, resource: str) -> bool:
        proc = k8s.run_kubectl(
            "auth", "can-i", verb, resource, "-n", namespace, "--as", user, check=False
        )
        assert proc.stdout.strip() in ("yes", "no"), proc.stderr
        return proc.stdout.strip() == "yes"

    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
    )
    assert not can_i("list", "pods")

    rbac.create_namespaced_role(
        namespace,
        client.V1Role(
            metadata=client.V1ObjectMeta(name="pod-reader"),
            rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["get", "list"])],
        ),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader-reads-pods"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    wait_for("RBAC to allow list pods", lambda: can_i("list", "pods"), timeout=20, interval=0.25)
    assert not can_i("delete", "pods")
    assert not can_i("list", "secrets")

    review = authz.create_subject_access_review(
        client.V1SubjectAccessReview(
            spec=client.V1SubjectAccessReviewSpec(
                user=user,
                groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                resource_attributes=client.V1ResourceAttributes(
                    namespace=namespace, verb="get", resource="pods"
                ),
            )
        )
    )
    assert review.status.allowed, review.status

    # A real token for the ServiceAccount (signed with the cluster's SA key) gets the same answer.
    token = core.create_namespaced_service_account_token(
        "reader",
        namespace,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
        ),
    ).status.token
    # (An empty kubeconfig, so that the admin client certificate is not sent as well.)
    env = {**k8s.env, "KUBECONFIG": os.devnull}
    base = [k8s.kubectl, "--server", k8s.server, "--certificate-authority"]
    base += [str(k8s.workdir / "pki" / "ca.crt"), "--token", token, "-n", namespace]
    ok = subprocess.run([*base, "get", "pods"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    denied = subprocess.run([*base, "get", "secrets"], capture_output=True, text=True, env=env)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()


def test_helm_install_trivial_chart(k8s, namespace):
    core, apps = client.CoreV1Api(k8s.api), client.AppsV1Api(k8s.api)
    k8s.run_helm("lint", str(CHART))
    install = k8s.run_helm(
        "install",
        "smoke",
        str(CHART),
        "-n",
        namespace,
        "--set",
        "message=hi from helm",
        "--wait",
        "--timeout",
        "90s",
    )
    assert "STATUS: deployed" in install.stdout, install.stdout

    releases = json.loads(k8s.run_helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("smoke", "deployed")]
    assert core.read_namespaced_config_map("smoke-config", namespace).data == {
        "message": "hi from helm"
    }
    dep = apps.read_namespaced_deployment("smoke", namespace)
    assert dep.status.available_replicas == 1

    k8s.run_helm("uninstall", "smoke", "-n", namespace, "--wait", "--timeout", "60s")
    assert json.loads(k8s.run_helm("list", "-n", namespace, "-o", "json").stdout) == []


def test_job_completes_and_garbage_collector_cascades(k8s, namespace):
    batch, apps = client.BatchV1Api(k8s.api), client.AppsV1Api(k8s.api)
    core = client.CoreV1Api(k8s.api)
    batch.create_namespaced_job(
        namespace,
        client.V1Job(
            metadata=client.V1ObjectMeta(name="once"),
            spec=client.V1JobSpec(
                backoff_limit=0,
                template=client.V1PodTemplateSpec(
                    spec=client.V1PodSpec(
                        restart_policy="Never",
                        containers=[client.V1Container(name="c", image="fake-image:0")],
                    )
                ),
            ),
        ),
    )
    wait_for(
        "job once to succeed (kwok pod-complete stage)",
        lambda: (batch.read_namespaced_job_status("once", namespace).status.succeeded or 0) == 1,
        interval=0.25,
    )

    labels = {"app": "gc"}
    apps.create_namespaced_deployment(
        namespace,
        {
            "metadata": {"name": "gc"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "fake-image:0"}]},
                },
            },
        },
    )
    wait_for(
        "deployment gc ready",
        lambda: (apps.read_namespaced_deployment("gc", namespace).status.ready_replicas or 0) == 2,
        interval=0.25,
    )
    # Background deletion: the garbage collector removes the ReplicaSet and then the Pods.
    apps.delete_namespaced_deployment("gc", namespace, propagation_policy="Background")
    wait_for(
        "ReplicaSet and Pods of gc to be garbage-collected",
        lambda: (
            not apps.list_namespaced_replica_set(namespace, label_selector="app=gc").items
            and not core.list_namespaced_pod(namespace, label_selector="app=gc").items
        ),
        interval=0.25,
    )
