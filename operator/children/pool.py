"""The Gateway API Inference Extension InferencePool over the server pods."""

from __future__ import annotations

from batchpilot.operator.children.meta import PORT, Owner, child_metadata, selector_labels
from batchpilot.operator.children.picker import picker_name
from batchpilot.operator.crd.spec import InferenceServiceSpec

# A child only with spec.routing.inferencePool: the reconcile deletes it after.
INFERENCE_POOL_KIND = ("inference.networking.k8s.io/v1", "InferencePool")


def build_inference_pool(owner: Owner, spec: InferenceServiceSpec) -> dict:
    """A Gateway API Inference Extension InferencePool over the server pods: the gateway
    asks the endpoint picker which pod of the pool takes each request, and the picker reads
    each pod's vLLM queue and KV-cache metrics on the serving port."""
    epp = spec.routing.endpoint_picker
    assert epp is not None  # RoutingSpec's rule
    # The picker the operator deploys, or the user's Service.
    service = picker_name(owner, epp) if epp.deployed else epp.name
    return {
        "apiVersion": INFERENCE_POOL_KIND[0],
        "kind": INFERENCE_POOL_KIND[1],
        "metadata": child_metadata(owner, owner.name),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "targetPorts": [{"number": PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "kind": "Service",
                "name": service,
                "port": {"number": epp.port},
                "failureMode": epp.failure_mode,
            },
        },
    }
