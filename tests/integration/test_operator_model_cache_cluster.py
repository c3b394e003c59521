"""The model cache (spec.model.cache) through the real control plane: the API server
refuses bad caches; the operator creates the claim and the fill Job and starts no pod while
the Job cannot run (the claim is Pending: no volume yet); once a volume binds it, kwok runs
the Job's pod to success (its pod-complete stage), the Job controller marks the Job
Complete, and the Deployment appears with the claim mounted read-only and the server
loading the cached directory."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from batchpilot.operator.children.cache import CACHE_COMPONENT
from batchpilot.operator.children.meta import LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGED_BY
from batchpilot.operator.children.plan import cache_key
from tests.support.cluster import IMAGE, not_found, operator
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster

CLASS = "batchpilot-cache-test"  # no StorageClass of this name: only the test's volume binds


@pytest.mark.parametrize(
    "model, message",
    [
        ({"source": "pvc://weights/m", "cache": {"claimName": "c"}}, "on a claim already"),
        ({"cache": {"claimName": "Upper"}}, "spec.model.cache.claimName in body should match"),
        ({"cache": {"claimName": "c", "size": "lots"}}, "spec.model.cache.size"),
        ({"cache": {"claimName": "c", "accessModes": ["ReadOnlyMany"]}}, "Unsupported value"),
    ],
)
def test_the_api_server_refuses_bad_caches(api, model, message):
    with pytest.raises(client.ApiException) as e:
        api.create("bad", {"model": model})
    assert e.value.status == 422 and message in e.value.body, e.value.body


def condition(api, name: str, type_: str) -> tuple[str, str, str]:
    c = api.condition(name, type_)
    return c.get("status", ""), c.get("reason", ""), c.get("message", "")


def fill_job(api, name: str):
    selector = f"{LABEL_COMPONENT}={CACHE_COMPONENT}"
    jobs = client.BatchV1Api(api.k8s.api).list_namespaced_job(api.ns, label_selector=selector)
    return next((j for j in jobs.items if j.metadata.owner_references[0].name == name), None)


def host_path_volume(name: str) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {
            "storageClassName": CLASS,
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "hostPath": {"path": f"/tmp/{name}"},  # never mounted: kwok runs no container
        },
    }


def test_the_pods_wait_for_the_fill_job(api):
    cache = {"claimName": "models", "size": "1Gi", "storageClassName": CLASS,
             "accessModes": ["ReadWriteOnce"]}  # fmt: skip
    volume = f"cache-{uuid.uuid4().hex[:8]}"
    path = f"/models/models/{cache_key('bundled', IMAGE)}"
    try:
        with operator(api):
            api.create("cached", {"model": {"cache": cache}})
            wait_for(
                "Filling, waiting for the claim",
                lambda: "Pending" in condition(api, "cached", "ModelCacheReady")[2],
                not_yet=not_found,
            )
            assert condition(api, "cached", "ModelCacheReady")[:2] == ("False", "Filling")
            assert condition(api, "cached", "Ready")[:2] == ("False", "ModelCacheFilling")
            with pytest.raises(client.ApiException) as e:
                api.apps.read_namespaced_deployment("cached", api.ns)
            assert e.value.status == 404  # no pod while the fill cannot run

            claim = api.core.read_namespaced_persistent_volume_claim("models", api.ns)
            assert claim.metadata.labels[LABEL_MANAGED_BY] == MANAGED_BY
            assert not claim.metadata.owner_references  # outlives the service
            assert claim.spec.storage_class_name == CLASS
            job = fill_job(api, "cached")
            assert job is not None and job.metadata.owner_references[0].controller
            (c,) = job.spec.template.spec.containers
            assert c.command + c.args == [
                "batchpilot", "model", "cache", "--source", "bundled", "--output", path
            ]  # fmt: skip
            mount = next(m for m in c.volume_mounts if m.mount_path == "/models/models")
            assert not mount.read_only

            api.core.create_persistent_volume(host_path_volume(volume))
            wait_for(
                "ModelCacheReady",
                lambda: condition(api, "cached", "ModelCacheReady")[0] == "True",
                timeout=180,  # the claim binder's resync (15 s), then the Job's pod
                not_yet=not_found,
            )
            assert (fill_job(api, "cached").status.succeeded or 0) == 1
            dep = wait_for(
                "the Deployment",
                lambda: api.apps.read_namespaced_deployment("cached", api.ns),
                not_yet=not_found,
            )
            pod = dep.spec.template.spec
            args = pod.containers[0].args
            assert args[args.index("--model") + 1] == path
            mount = next(m for m in pod.containers[0].volume_mounts
                         if m.mount_path == "/models/models")  # fmt: skip
            assert mount.read_only
            volume_of = next(v for v in pod.volumes if v.name == mount.name)
            assert volume_of.persistent_volume_claim.claim_name == "models"
            assert volume_of.persistent_volume_claim.read_only
            wait_for("Ready", lambda: api.ready("cached"), not_yet=not_found)
            assert condition(api, "cached", "Degraded")[0] == "False"
    finally:
        try:
            api.core.delete_persistent_volume(volume)
        except client.ApiException as e:
            if e.status != 404:
                raise
