"""The autoscaler the spec may ask the operator to emit: an HPA or a KEDA ScaledObject,
both scaling the InferenceService through its scale subresource."""

from __future__ import annotations

from batchpilot import names
from batchpilot.operator.children.meta import Owner, child_metadata
from batchpilot.operator.children.quantity import quantity
from batchpilot.operator.crd.api import API_VERSION, KIND
from batchpilot.operator.crd.spec import InferenceServiceSpec

HPA_METRIC = names.NUM_REQUESTS_WAITING
KEDA_API_VERSION = "keda.sh/v1alpha1"
# Children that exist only in some autoscaling modes: (apiVersion, kind), named like the
# service. The reconcile deletes those the spec no longer asks for.
HPA_KIND = ("autoscaling/v2", "HorizontalPodAutoscaler")
SCALED_OBJECT_KIND = (KEDA_API_VERSION, "ScaledObject")


def scale_target(owner: Owner) -> dict:
    """HPA and KEDA scale the InferenceService through its scale subresource (spec.replicas):
    the operator keeps owning the Deployment."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name}


def hpa_behavior(spec: InferenceServiceSpec) -> dict:
    a = spec.autoscaling
    return {
        "scaleUp": {"stabilizationWindowSeconds": a.scale_up_stabilization_seconds},
        "scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_seconds},
    }


def build_hpa(owner: Owner, spec: InferenceServiceSpec) -> dict:
    """autoscaling/v2, on the external metric vllm:num_requests_waiting of this service's
    servers (an external metrics adapter such as prometheus-adapter serves it, with the
    namespace and service labels its Prometheus attaches): the queue per replica is held
    at targetQueueLength."""
    a = spec.autoscaling
    selector = {"matchLabels": {"namespace": owner.namespace, "service": owner.name}}
    metric = {
        "type": "External",
        "external": {
            "metric": {"name": HPA_METRIC, "selector": selector},
            "target": {"type": "AverageValue", "averageValue": quantity(a.target_queue_length)},
        },
    }
    return {
        "apiVersion": HPA_KIND[0],
        "kind": HPA_KIND[1],
        "metadata": child_metadata(owner, owner.name),
        "spec": {
            "scaleTargetRef": scale_target(owner),
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [metric],
            "behavior": hpa_behavior(spec),
        },
    }


def keda_query(owner: Owner, spec: InferenceServiceSpec) -> str:
    return spec.autoscaling.keda.query or (
        f'sum({HPA_METRIC}{{namespace="{owner.namespace}",service="{owner.name}"}})'
    )


def build_scaled_object(owner: Owner, spec: InferenceServiceSpec) -> dict:
    """A KEDA ScaledObject with a Prometheus trigger: KEDA runs the HPA and serves it the
    query's value; threshold is the target per replica."""
    a = spec.autoscaling
    trigger = {
        "type": "prometheus",
        "metadata": {
            "serverAddress": a.keda.server_address,
            "query": keda_query(owner, spec),
            "threshold": f"{a.target_queue_length:g}",
        },
    }
    return {
        "apiVersion": SCALED_OBJECT_KIND[0],
        "kind": SCALED_OBJECT_KIND[1],
        "metadata": child_metadata(owner, owner.name),
        "spec": {
            "scaleTargetRef": scale_target(owner),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": hpa_behavior(spec)}},
            "triggers": [trigger],
        },
    }


def autoscaler_kind(spec: InferenceServiceSpec) -> tuple[str, str] | None:
    """(apiVersion, kind) of the autoscaler the spec asks the operator to emit, if any."""
    a = spec.autoscaling
    return {"hpa": HPA_KIND, "keda": SCALED_OBJECT_KIND}.get(a.mode) if a.enabled else None


def autoscaler_children(owner: Owner, spec: InferenceServiceSpec) -> list[dict]:
    kind = autoscaler_kind(spec)
    if kind is None:
        return []
    return [build_hpa(owner, spec) if kind == HPA_KIND else build_scaled_object(owner, spec)]
