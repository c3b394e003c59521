"""Scale to zero through the real control plane: an idle service goes to zero, its Service
switches to the activator (a selector no pod matches; an EndpointSlice of the operator's with the
activator's addresses), a wake request brings a replica back, and once it is Ready the
Service selects the replicas again and the activator's slice is gone. Then the activator's
own Kubernetes adapter (activator/kube.py's KubeTargets) against the same API server.

As in test_operator_loop_cluster.py, kwok's pods serve nothing, so the loop reads a real
idle `batchpilot serve` on 127.0.0.1 (OperatorConfig.metrics_urls). The activator is
represented by its Service and the EndpointSlice the EndpointSlice controller would write
for the chart's activator pods; its data path is tested in test_activator.py and in kind.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from kubernetes import client

from batchpilot.operator.activator.kube import KubeTargets
from batchpilot.operator.children.meta import Owner, selector_labels
from batchpilot.operator.children.service import (
    SLICE_SERVICE_NAME,
    build_activator_slice,
    controller_slices_selector,
    service_selector,
)
from batchpilot.operator.children.service import Activator as SliceActivator
from batchpilot.operator.loop.idle import WAKE_ANNOTATION
from batchpilot.operator.loop.timestamps import parse_timestamp, timestamp
from tests.support.cluster import Api, loop_operator, not_found, operator, server, start
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster

ACTIVATOR = "activator"
ACTIVATOR_IP, ACTIVATOR_PORT = "10.244.7.7", 8080
SPEC = {
    "replicas": 1,
    "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                    "scaleToZeroAfterSeconds": 60},
}  # fmt: skip


def activator_endpoints(cluster: Api) -> None:
    """The chart's activator Service, with the slice the EndpointSlice controller would
    write for one Ready activator pod."""
    cluster.core.create_namespaced_service(
        cluster.ns,
        {
            "metadata": {"name": ACTIVATOR},
            "spec": {"ports": [{"name": "http", "port": 8000, "targetPort": ACTIVATOR_PORT}]},
        },
    )
    client.DiscoveryV1Api(cluster.k8s.api).create_namespaced_endpoint_slice(
        cluster.ns,
        {
            "metadata": {
                "name": f"{ACTIVATOR}-abcde",
                "labels": {SLICE_SERVICE_NAME: ACTIVATOR},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ACTIVATOR_IP], "conditions": {"ready": True}}],
            "ports": [{"name": "http", "port": ACTIVATOR_PORT, "protocol": "TCP"}],
        },
    )


def slice_of(cluster: Api, name: str) -> client.V1EndpointSlice | None:
    try:
        return client.DiscoveryV1Api(cluster.k8s.api).read_namespaced_endpoint_slice(
            name, cluster.ns
        )
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def controller_slices(cluster: Api, name: str) -> list:
    return (
        client.DiscoveryV1Api(cluster.k8s.api)
        .list_namespaced_endpoint_slice(cluster.ns, label_selector=controller_slices_selector(name))
        .items
    )


def replicas(cluster: Api, name: str) -> int:
    return cluster.apps.read_namespaced_deployment(name, cluster.ns).spec.replicas


def selector(cluster: Api, name: str) -> dict | None:
    return cluster.core.read_namespaced_service(name, cluster.ns).spec.selector


def test_idle_to_zero_through_the_activator_and_back(api, tiny_path, tmp_path):
    activator_endpoints(api)
    srv = server(tiny_path, tmp_path)
    try:
        with loop_operator(api, [srv], activator_service=f"{api.ns}/{ACTIVATOR}") as runner:
            api.create("chat", SPEC)
            start(srv, api, "chat")
            wait_for(
                "Ready with a replica", lambda: api.ready("chat"), timeout=180, not_yet=not_found
            )
            assert selector(api, "chat") == selector_labels("chat")
            assert slice_of(api, "chat") is None

            # Idle (the server gets no request): to zero after scaleToZeroAfterSeconds.
            started = time.time()
            wait_for(
                "scaled to zero", lambda: replicas(api, "chat") == 0, timeout=300, not_yet=not_found
            )
            autoscaling = api.get("chat")["status"]["autoscaling"]
            idle = parse_timestamp(autoscaling["scaledToZeroTime"]) - parse_timestamp(
                autoscaling["lastActiveTime"]
            )
            assert idle >= 60 and time.time() - started >= 55, autoscaling
            event = wait_for(
                "the Event", lambda: api.events("chat").get("ScaledToZero"), not_yet=not_found
            )
            assert "idle for" in event, event
            # The Service now routes to the activator.
            routed = service_selector("chat", to_activator=True)
            wait_for(
                "the Service selecting no pod",
                lambda: selector(api, "chat") == routed,
                not_yet=not_found,
            )
            # The EndpointSlice controller still syncs the Service: its slices hold no pod
            # (a stale one would take part of the traffic at zero).
            wait_for(
                "the EndpointSlice controller's slices empty",
                lambda: all(not s.endpoints for s in controller_slices(api, "chat")),
                not_yet=not_found,
            )
            eps = slice_of(api, "chat")
            assert [e.addresses for e in eps.endpoints] == [[ACTIVATOR_IP]]
            assert [(p.name, p.port) for p in eps.ports] == [("http", ACTIVATOR_PORT)]
            assert eps.metadata.labels[SLICE_SERVICE_NAME] == "chat"
            assert eps.metadata.owner_references[0].kind == "InferenceService"
            ready = wait_for(
                "Ready (ScaledToZero)",
                lambda: (c := api.condition("chat", "Ready")).get("reason") == "ScaledToZero" and c,
                not_yet=not_found,
            )
            assert ready["status"] == "True", ready

            # A wake request (the activator holds a request): one replica at once, not at
            # the next idle period; the Service stays on the activator until it is Ready.
            woken = time.time()
            api.custom.patch_namespaced_custom_object(
                "batchpilot.dev", "v1alpha1", api.ns, "inferenceservices", "chat",
                {"metadata": {"annotations": {WAKE_ANNOTATION: timestamp(woken)}}},
            )  # fmt: skip
            wait_for(
                "one replica again",
                lambda: replicas(api, "chat") == 1,
                timeout=60,
                not_yet=not_found,
            )
            assert "WokenFromZero" in api.events("chat")
            wait_for(
                "the Service selecting the replicas again",
                lambda: selector(api, "chat") == selector_labels("chat"),
                timeout=120,
                not_yet=not_found,
            )
            wait_for(
                "the activator's slice gone",
                lambda: slice_of(api, "chat") is None,
                not_yet=not_found,
            )
            wait_for(
                "the controller's slices holding the replica",
                lambda: any(s.endpoints for s in controller_slices(api, "chat")),
                not_yet=not_found,
            )
            wait_for(
                "Ready with a replica", lambda: api.ready("chat"), timeout=120, not_yet=not_found
            )
            assert (
                "scaledToZeroTime" not in api.get("chat")["status"]["autoscaling"]
            )  # merge-patched away
        # The wake ran a turn from its own watch event, not only at the timer's next tick
        # (kopf does not diff the annotation: a field handler on it never ran).
        assert "Handler 'wake' succeeded" in runner.output, runner.output[-3000:]
    finally:
        srv.stop()


def test_the_activators_kubernetes_adapter(api, k8s):
    """KubeTargets as the activator runs it, from its watches: a service that is up is not
    the activator's, whatever the Host (security finding 1); once the operator's slice
    routes it here, its full name, its ClusterIP and, from a pod of its namespace, its bare
    name resolve; a flood of made-up hosts costs the API server nothing; endpoints are its
    Ready pods on the serving port, and wake annotates it."""

    name = f"adapter-{api.ns[-6:]}"  # the cluster is shared: a name no other test uses
    with operator(api, cleanup=False):
        api.create(name, {"replicas": 1})
        wait_for("Ready", lambda: api.ready(name), timeout=180, not_yet=not_found)
    # The operator is stopped (its children stay): it would delete a routing slice of a
    # service that is up.
    api_client = client.ApiClient(k8s.api.configuration)
    targets = KubeTargets(api_client, [api.ns])
    targets.start()
    try:
        wait_for("the watches listed", lambda: targets.routes.synced, timeout=60)
        cluster_ip = api.core.read_namespaced_service(name, api.ns).spec.cluster_ip
        pods = api.core.list_namespaced_pod(api.ns, label_selector=f"batchpilot.dev/service={name}")
        pod_ip = pods.items[0].status.pod_ip
        hosts = [f"{name}.{api.ns}", f"{name}.{api.ns}.svc.cluster.local", cluster_ip, name]

        def resolve_all(client_ip: str) -> list:
            return asyncio.run(_resolve_each(targets, hosts, client_ip))

        assert resolve_all(pod_ip) == [None] * 4  # up, not routed: not the activator's

        owner = Owner.from_body(api.get(name))
        routing = build_activator_slice(owner, SliceActivator((ACTIVATOR_IP,), ACTIVATOR_PORT))
        client.DiscoveryV1Api(api_client).create_namespaced_endpoint_slice(api.ns, routing)
        wait_for("routed", lambda: targets.routes.is_routed((api.ns, name)), timeout=60)
        assert resolve_all(pod_ip) == [(api.ns, name)] * 4
        # A bare name from a client outside the namespace's pods: not resolved.
        assert resolve_all("10.250.0.9")[3] is None

        calls = count_api_calls(api_client)
        junk = [f"svc-{i}.ns-{i}" for i in range(500)] + [f"svc-{i}" for i in range(500)]
        assert set(asyncio.run(_resolve_each(targets, junk, pod_ip))) == {None}
        assert calls == [], calls[:3]

        assert asyncio.run(targets.endpoints(api.ns, name)) == [
            f"http://{p.status.pod_ip}:8000" for p in pods.items
        ]
        before = time.time()
        asyncio.run(targets.wake(api.ns, name))
        stamp = api.get(name)["metadata"]["annotations"][WAKE_ANNOTATION]
        assert before - 1 <= parse_timestamp(stamp) <= time.time() + 1
    finally:
        targets.stop()

    other = KubeTargets(api_client, ["some-other-namespace"])
    other.start()
    try:
        wait_for("the watches listed", lambda: other.routes.synced, timeout=60)
        assert asyncio.run(_resolve_each(other, [f"{name}.{api.ns}"], pod_ip)) == [None]
    finally:
        other.stop()


async def _resolve_each(targets: KubeTargets, hosts: list[str], client_ip: str) -> list:
    return [await targets.resolve(host, client_ip) for host in hosts]


def count_api_calls(api_client: client.ApiClient) -> list[tuple]:
    """The API calls made through api_client from now on (the watches' streams, opened
    before, are not new calls)."""
    calls: list[tuple] = []
    call_api = api_client.call_api

    def counted(resource_path, method, *args, **kwargs):
        calls.append((method, resource_path))
        return call_api(resource_path, method, *args, **kwargs)

    api_client.call_api = counted
    return calls
