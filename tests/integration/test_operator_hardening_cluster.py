"""Issue 19's operator hardening against the real control plane: an InferenceService never
takes over, changes or garbage-collects an object of its children's names that someone else
made, and its server pods are admitted where the restricted Pod Security Standard is
enforced (the API server's own PodSecurity admission). The CRD's refusals (hostPath,
extraArgs abbreviations, security fields) are in test_operator_cluster.py's tables."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from batchpilot.operator.crd.api import GROUP, PLURAL, VERSION
from tests.support.cluster import Api, not_found, operator
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster

PAUSE = "registry.k8s.io/pause:3.10"  # kwok runs nothing: any image name does


def foreign_objects(api: Api, hpas: client.AutoscalingV2Api) -> None:
    """A Deployment, a Service, an HPA and a Secret, made by someone else, named like the
    children of the InferenceServices `dep`, `svc`, `hpa` and `sec` (the Secret with the
    name the operator used before its names were derived from the token)."""
    labels = {"app": "theirs"}
    api.apps.create_namespaced_deployment(
        api.ns,
        {
            "metadata": {"name": "dep", "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": PAUSE}]},
                },
            },
        },
    )
    api.core.create_namespaced_service(
        api.ns,
        {
            "metadata": {"name": "svc", "labels": labels},
            "spec": {"selector": labels, "ports": [{"name": "web", "port": 80}]},
        },
    )
    hpas.create_namespaced_horizontal_pod_autoscaler(
        api.ns,
        {
            "metadata": {"name": "hpa", "labels": labels},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "dep"},
                "minReplicas": 1,
                "maxReplicas": 2,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {
                            "name": "cpu",
                            "target": {"type": "Utilization", "averageUtilization": 80},
                        },
                    }
                ],
            },
        },
    )
    api.core.create_namespaced_secret(
        api.ns,
        {
            "metadata": {"name": "sec-admin-token", "labels": labels},
            "stringData": {"token": "theirs"},
        },
    )


def snapshot(api: Api, hpas: client.AutoscalingV2Api) -> dict[str, dict]:
    """What must not change: the declared content, owner references, labels, who has
    written it (the operator's field manager never) and its version: metadata.generation
    for the Deployment, resourceVersion for the Service and Secret (the HPA has neither
    that its controller's status writes leave alone)."""
    objs = {
        "Deployment": api.apps.read_namespaced_deployment("dep", api.ns),
        "Service": api.core.read_namespaced_service("svc", api.ns),
        "HorizontalPodAutoscaler": hpas.read_namespaced_horizontal_pod_autoscaler("hpa", api.ns),
        "Secret": api.core.read_namespaced_secret("sec-admin-token", api.ns),
    }
    out = {}
    for kind, obj in objs.items():
        d = api.k8s.api.sanitize_for_serialization(obj)
        meta = d["metadata"]
        out[kind] = {
            "version": meta.get("generation")
            or (meta["resourceVersion"] if kind in ("Service", "Secret") else None),
            "managers": sorted(
                {m["manager"] for m in meta["managedFields"] if m.get("subresource") != "status"}
            ),
            "ownerReferences": meta.get("ownerReferences"),
            "labels": d["metadata"].get("labels"),
            "content": d.get("spec", d.get("data")),
        }
    return out


def test_names_taken_by_others_are_left_untouched_reported_and_never_collected(api, k8s):
    hpas = client.AutoscalingV2Api(k8s.api)
    foreign_objects(api, hpas)
    before = snapshot(api, hpas)
    assert all("batchpilot-operator" not in v["managers"] for v in before.values())
    with operator(api):
        api.create("dep", {})
        api.create("svc", {})
        api.create("hpa", {"autoscaling": {"enabled": True, "mode": "hpa"}})
        api.create("sec", {})
        for name, kind in (
            ("dep", "Deployment"),
            ("svc", "Service"),
            ("hpa", "HorizontalPodAutoscaler"),
        ):
            c = wait_for(
                f"{name} Degraded (NameConflict)",
                lambda n=name: (
                    (c := api.condition(n, "Degraded")).get("reason") == "NameConflict" and c
                ),
                timeout=120,
                not_yet=not_found,
            )
            assert c["status"] == "True"
            assert f"{kind} {name!r} exists, with no controller" in c["message"], c
            assert "left untouched" in c["message"]
            assert api.condition(name, "Ready")["status"] == "False"
            event = wait_for(
                f"a NameConflict Event on {name}",
                lambda n=name: api.events(n).get("NameConflict"),
                not_yet=not_found,
            )
            assert f"{kind} {name!r}" in event
            # Nothing of it was built: status describes no Deployment (not the foreign one).
            st = api.get(name)["status"]
            assert st["replicas"] == 0 and "engine" not in st and "image" not in st
        # The Secret's name is derived from the token: no one could have taken it, so `sec`
        # serves, with a Secret of its own; the old-style name is someone else's, unused.
        wait_for("sec Ready", lambda: api.ready("sec"), timeout=120, not_yet=not_found)
        assert api.secret_name("sec") != "sec-admin-token"
        assert api.token("sec") == api.derived_token("sec")
        assert snapshot(api, hpas) == before
        # Deleting the InferenceServices collects their own children only.
        for name in ("dep", "svc", "hpa", "sec"):
            api.delete(name)
        wait_for(
            "the InferenceServices gone",
            lambda: (
                not api.custom.list_namespaced_custom_object(GROUP, VERSION, api.ns, PLURAL)[
                    "items"
                ]
            ),
            timeout=120,
            not_yet=not_found,
        )
    wait_for(
        "sec's own children garbage-collected",
        lambda: not any(api.children().values()),
        timeout=120,
        not_yet=not_found,
    )
    assert snapshot(api, hpas) == before


def test_server_pods_are_admitted_where_restricted_is_enforced(api, k8s):
    k8s.run_kubectl(
        "label",
        "namespace",
        api.ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )
    # The API server enforces it: a pod without the restricted settings is refused.
    plain = {"metadata": {"name": "plain"}, "spec": {"containers": [{"name": "c", "image": PAUSE}]}}
    with pytest.raises(client.ApiException) as e:
        api.core.create_namespaced_pod(api.ns, plain, dry_run="All")
    assert e.value.status == 403, e.value.body
    assert "violates PodSecurity" in json.loads(e.value.body)["message"]

    spec = {
        "replicas": 2,
        # Volumes of the restricted list pass through.
        "pod": {
            "volumes": [{"name": "extra", "configMap": {"name": "extra", "optional": True}}],
            "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True}],
        },
    }
    with operator(api):
        api.create("chat", spec)
        st = wait_for(
            "2 server pods Ready under restricted",
            lambda: (s := api.ready("chat")) and s["readyReplicas"] == 2 and s,
            timeout=120,
            not_yet=not_found,
        )
        assert st["replicas"] == 2
        pods = api.core.list_namespaced_pod(api.ns, label_selector="batchpilot.dev/service=chat")
        assert len(pods.items) == 2
        pod = pods.items[0].spec
        assert pod.security_context.run_as_non_root and pod.security_context.run_as_user == 10001
        assert pod.security_context.seccomp_profile.type == "RuntimeDefault"
        (c,) = pod.containers
        sc = c.security_context
        assert sc.read_only_root_filesystem and sc.allow_privilege_escalation is False
        assert sc.capabilities.drop == ["ALL"] and not sc.capabilities.add
        assert {p.name: p.container_port for p in c.ports} == {"http": 8000, "admin": 8001}
        # The Service exposes the public port only.
        ports = api.core.read_namespaced_service("chat", api.ns).spec.ports
        assert [p.port for p in ports] == [8000]
        failed = [
            e for e in api.core.list_namespaced_event(api.ns).items if e.reason == "FailedCreate"
        ]
        assert not failed, [e.message for e in failed]
