"""The Service, and the EndpointSlice that routes it to the activator while a service that
may go to zero has no Ready replica."""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot.operator.children.meta import (
    MANAGED_BY,
    PORT,
    PORT_NAME,
    Owner,
    child_metadata,
    scrape_annotations,
    selector_labels,
)
from batchpilot.operator.crd.spec import InferenceServiceSpec

# A child only while the Service routes to the activator: the reconcile deletes it after.
ENDPOINT_SLICE_KIND = ("discovery.k8s.io/v1", "EndpointSlice")
# The EndpointSlice controller manages the slices of Services with a selector; a Service
# without one (routed to the activator) gets ours, marked so that controller leaves it.
SLICE_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
SLICE_SERVICE_NAME = "kubernetes.io/service-name"
SLICE_CONTROLLER = "endpointslice-controller.k8s.io"
# Added to the Service's selector while it routes to the activator: no pod has it, so the
# EndpointSlice controller keeps syncing the Service (its slices go empty as the last pod
# goes) while the operator's own slice holds the activator. Dropping the selector instead
# races the controller: it stops syncing, and a slice it had just remade kept a gone pod,
# which timed out 4 of 8 requests at zero in kind.
LABEL_ROUTED = "batchpilot.dev/routed-to"


def service_url(name: str, namespace: str, cluster_domain: str) -> str:
    return f"http://{name}.{namespace}.svc.{cluster_domain}:{PORT}"


@dataclass(frozen=True)
class Activator:
    """Where the activator listens: its Ready pods' addresses and their port."""

    addresses: tuple[str, ...]
    port: int


def activator_of(slices: list[dict]) -> Activator | None:
    """The activator from its Service's EndpointSlices (Ready endpoints, the port named
    http); None when no slice names that port yet."""
    port = next(
        (p["port"] for s in slices for p in s.get("ports") or [] if p.get("name") == PORT_NAME),
        None,
    )
    if port is None:
        return None
    addresses = sorted(
        {
            a
            for s in slices
            for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready", True)
            for a in e.get("addresses") or []
        }
    )
    return Activator(tuple(addresses), port)


def may_route_to_activator(spec: InferenceServiceSpec) -> bool:
    """A service the built-in autoscaler may take to zero."""
    return spec.autoscaling.builtin and spec.autoscaling.min_replicas == 0


def routes_to_activator(
    spec: InferenceServiceSpec, desired: int, ready: int, activator: Activator | None
) -> bool:
    """Does the Service send its traffic to the activator? Only for a service that may go
    to zero, while none of its replicas is Ready: at zero, and while the first one starts."""
    return activator is not None and may_route_to_activator(spec) and (desired == 0 or ready == 0)


def service_selector(name: str, *, to_activator: bool = False) -> dict[str, str]:
    """The server pods; while the Service routes to the activator, none (LABEL_ROUTED)."""
    routed = {LABEL_ROUTED: "activator"} if to_activator else {}
    return {**selector_labels(name), **routed}


def build_service(owner: Owner, *, to_activator: bool = False) -> dict:
    """While it routes to the activator, its selector matches no pod, and its endpoints
    are the activator's, in the EndpointSlice the operator writes (build_activator_slice)."""
    selector = {"selector": service_selector(owner.name, to_activator=to_activator)}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner, owner.name, scrape_annotations()),
        "spec": {
            "type": "ClusterIP",
            **selector,
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": PORT,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def controller_slices_selector(name: str) -> str:
    """The EndpointSlice controller's slices of the Service ``name``."""
    return f"{SLICE_SERVICE_NAME}={name},{SLICE_MANAGED_BY}={SLICE_CONTROLLER}"


def build_activator_slice(owner: Owner, activator: Activator) -> dict:
    """The Service's endpoints while it routes to the activator: the activator's pods, on
    the activator's port, under the Service's port name."""
    meta = child_metadata(owner, owner.name)
    meta["labels"] = {
        **meta["labels"],
        SLICE_SERVICE_NAME: owner.name,
        SLICE_MANAGED_BY: MANAGED_BY,
    }
    return {
        "apiVersion": ENDPOINT_SLICE_KIND[0],
        "kind": ENDPOINT_SLICE_KIND[1],
        "metadata": meta,
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [a], "conditions": {"ready": True}} for a in activator.addresses
        ],
        "ports": [{"name": PORT_NAME, "port": activator.port, "protocol": "TCP"}],
    }
