"""spec.routing.inferencePool against the real control plane with the Gateway API Inference
Extension's own InferencePool CRD (fetched from its Go module at GIE_VERSION by
tests/k8s/build.sh): the pool the operator emits is validated by the API server against
GIE's schema, selects exactly the service's server pods on the serving port, is owned by
the InferenceService, follows the spec and is collected with it. Without GIE's CRD the
service is Degraded, and it recovers once the CRD is installed. A pool of the same name
made by someone else is left alone."""

from __future__ import annotations

import contextlib
import json

import pytest
import yaml
from kubernetes import client
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError as DynamicNotFound

from batchpilot.operator.children.meta import PORT, selector_labels
from batchpilot.operator.children.picker import PICKER_KINDS, PICKER_RULES
from batchpilot.operator.children.pool import INFERENCE_POOL_KIND
from tests.k8s.cluster import gie_crd, versions
from tests.support.cluster import Api, not_found, operator
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster

POOL_GROUP, POOL_VERSION = INFERENCE_POOL_KIND[0].split("/")
POOL_PLURAL = "inferencepools"
POOL_CRD = f"{POOL_PLURAL}.{POOL_GROUP}"
ROUTING = {"inferencePool": True, "endpointPicker": {"name": "chat-epp", "port": 9002}}


def pool(cluster: Api, name: str) -> dict | None:
    try:
        return cluster.custom.get_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, cluster.ns, POOL_PLURAL, name
        )
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def served(k8s) -> bool:
    """Does discovery list InferencePools (the CRD is Established and mapped)?"""
    out = k8s.run_kubectl("api-resources", f"--api-group={POOL_GROUP}", "-o", "name", check=False)
    return POOL_CRD in out.stdout.split()


@pytest.fixture
def no_gie(k8s):
    """GIE's CRD absent for the test's start; installed again (or not) by the test."""
    k8s.run_kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=true")
    wait_for(
        "InferencePool no longer served", lambda: not served(k8s), timeout=120, not_yet=not_found
    )
    yield
    k8s.run_kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=false")


def install_gie(k8s) -> None:
    k8s.run_kubectl("apply", "--server-side", "-f", str(gie_crd()))
    k8s.run_kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{POOL_CRD}")
    wait_for("InferencePool served", lambda: served(k8s), timeout=60, not_yet=not_found)


def test_the_crd_refuses_a_pool_without_an_endpoint_picker(api):
    with pytest.raises(client.ApiException) as e:
        api.create("bad", {"routing": {"inferencePool": True}})
    assert e.value.status == 422, e.value.body
    message = json.loads(e.value.body)["message"]
    assert "routing.endpointPicker is required with routing.inferencePool" in message, message


def test_inference_pool_lifecycle(api, k8s, no_gie):
    with operator(api):
        # Without GIE's CRD: Degraded, saying what to install; nothing else is built.
        api.create("chat", {"replicas": 2, "routing": ROUTING})
        c = wait_for(
            "Degraded (InferencePoolNotServed)",
            lambda: (
                (c := api.condition("chat", "Degraded")).get("reason") == "InferencePoolNotServed"
                and c
            ),
            timeout=120,
            not_yet=not_found,
        )
        assert "Gateway API Inference Extension" in c["message"], c
        assert api.condition("chat", "Ready")["status"] == "False"

        # GIE's CRD installed: the pool appears (the operator looks a kind up again a minute
        # after it found it missing), valid under GIE's own schema, and the service serves.
        install_gie(k8s)
        p = wait_for("the InferencePool", lambda: pool(api, "chat"), timeout=240, not_yet=not_found)
        wait_for("chat Ready", lambda: api.ready("chat"), timeout=120, not_yet=not_found)
        assert p["spec"]["selector"] == {"matchLabels": selector_labels("chat")}
        assert p["spec"]["targetPorts"] == [{"number": PORT}]
        ref = p["spec"]["endpointPickerRef"]
        assert (ref["kind"], ref["name"], ref["port"]) == ("Service", "chat-epp", {"number": 9002})
        assert ref["failureMode"] == "FailClose"
        (owner,) = p["metadata"]["ownerReferences"]
        uid = api.get("chat")["metadata"]["uid"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceService", uid, True)
        # The pool selects exactly the service's server pods.
        selector = ",".join(f"{k}={v}" for k, v in p["spec"]["selector"]["matchLabels"].items())
        pods = api.core.list_namespaced_pod(api.ns, label_selector=selector).items
        assert len(pods) == 2
        assert all(pod.metadata.labels["batchpilot.dev/service"] == "chat" for pod in pods)

        # The spec's changes reach it; turned off, it is deleted (it is ours).
        api.patch("chat", {"routing": {"endpointPicker": {"failureMode": "FailOpen"}}})
        wait_for(
            "failureMode FailOpen",
            lambda: (pool(api, "chat") or {}).get("spec", {}).get("endpointPickerRef", {})
            .get("failureMode") == "FailOpen",
            timeout=120, not_yet=not_found,
        )  # fmt: skip
        api.patch("chat", {"routing": {"inferencePool": False}})
        wait_for(
            "the InferencePool deleted",
            lambda: pool(api, "chat") is None,
            timeout=120,
            not_yet=not_found,
        )
        api.patch("chat", {"routing": {"inferencePool": True}})
        wait_for(
            "the InferencePool again", lambda: pool(api, "chat"), timeout=120, not_yet=not_found
        )

        # Someone else's pool of a service's name is neither taken over nor deleted.
        theirs = {
            "apiVersion": INFERENCE_POOL_KIND[0],
            "kind": "InferencePool",
            "metadata": {"name": "web", "namespace": api.ns, "labels": {"app": "theirs"}},
            "spec": {
                "selector": {"matchLabels": {"app": "theirs"}},
                "targetPorts": [{"number": 8080}],
                "endpointPickerRef": {"name": "their-epp", "port": {"number": 9002}},
            },
        }
        api.custom.create_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, api.ns, POOL_PLURAL, theirs
        )
        before = pool(api, "web")
        api.create("web", {"routing": ROUTING})
        c = wait_for(
            "web Degraded (NameConflict)",
            lambda: (c := api.condition("web", "Degraded")).get("reason") == "NameConflict" and c,
            timeout=120,
            not_yet=not_found,
        )
        assert "InferencePool 'web' exists, with no controller" in c["message"], c
        api.delete("web")
        wait_for("web deleted", lambda: not _exists(api, "web"), timeout=120, not_yet=not_found)
        after = pool(api, "web")
        assert after is not None and after["spec"] == before["spec"]
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

        # Deleting the InferenceService collects its pool (the garbage collector, through
        # the owner reference).
        api.delete("chat")
        wait_for(
            "chat's InferencePool collected",
            lambda: pool(api, "chat") is None,
            timeout=180,
            not_yet=not_found,
        )


def _exists(cluster: Api, name: str) -> bool:
    try:
        cluster.get(name)
    except client.ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def test_the_crd_under_test_is_the_gie_modules_own():
    """GIE's file for InferencePool v1 at the pinned version, not our reading of it."""
    crd = yaml.safe_load(gie_crd().read_text())
    annotations = crd["metadata"]["annotations"]
    assert annotations["inference.networking.k8s.io/bundle-version"] == versions()["GIE_VERSION"]
    assert crd["spec"]["group"] == POOL_GROUP
    assert [v["name"] for v in crd["spec"]["versions"] if v["served"]] == [POOL_VERSION]


EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
DEPLOYED = {"inferencePool": True, "endpointPicker": {"image": EPP_IMAGE}}


def picker_objects(cluster: Api, name: str) -> dict[str, dict]:
    """The picker objects of that name, by kind, as the API server has them."""
    found, dynamic = {}, DynamicClient(cluster.k8s.api)
    for api_version, kind in PICKER_KINDS:
        resource = dynamic.resources.get(api_version=api_version, kind=kind)
        with contextlib.suppress(DynamicNotFound):
            found[kind] = resource.get(name=name, namespace=cluster.ns).to_dict()
    return found


def test_the_crd_refuses_a_deployed_picker_without_its_image_or_pool(api):
    for routing, message in (
        ({"inferencePool": True, "endpointPicker": {"deploy": True}}, "image is required"),
        ({"endpointPicker": {"image": EPP_IMAGE}}, "deploy needs routing.inferencePool"),
        ({"inferencePool": True, "endpointPicker": {"port": 9002}}, "name is required unless"),
    ):
        with pytest.raises(client.ApiException) as e:
            api.create("bad", {"routing": routing})
        assert e.value.status == 422, e.value.body
        assert message in json.loads(e.value.body)["message"]


def test_the_operator_runs_the_endpoint_picker(api, k8s):
    install_gie(k8s)
    with operator(api):
        api.create("chat", {"routing": DEPLOYED})
        objs = wait_for(
            "the picker's six objects",
            lambda: len(o := picker_objects(api, "chat-epp")) == len(PICKER_KINDS) and o,
            timeout=120,
            not_yet=not_found,
        )
        uid = api.get("chat")["metadata"]["uid"]
        for kind, obj in objs.items():
            (owner,) = obj["metadata"]["ownerReferences"]
            assert (owner["uid"], owner["controller"]) == (uid, True), kind
            assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == "endpoint-picker"
        # The API server took GIE's Role rules from the operator (it holds them: no
        # escalation), and the pool points at the picker's Service.
        assert objs["Role"]["rules"] == PICKER_RULES
        ref = wait_for("the pool", lambda: pool(api, "chat"), timeout=60, not_yet=not_found)
        assert ref["spec"]["endpointPickerRef"]["name"] == "chat-epp"

        # Turned off (a picker the user runs instead): every picker object goes.
        api.patch("chat", {"routing": {"endpointPicker": {"image": None, "name": "theirs"}}})
        wait_for(
            "the picker's objects deleted",
            lambda: not picker_objects(api, "chat-epp"),
            timeout=120,
            not_yet=not_found,
        )
        assert pool(api, "chat")["spec"]["endpointPickerRef"]["name"] == "theirs"
