"""spec.autoscaling: who sets the replica count, within which bounds, and scale to zero."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from batchpilot.operator.crd.base import CamelModel, Rule


class KedaSpec(CamelModel):
    """The KEDA ScaledObject's Prometheus trigger (autoscaling.mode: keda)."""

    server_address: str | None = Field(None, max_length=1024, pattern=r"^https?://\S+$")
    """The Prometheus that scrapes the servers, e.g. http://prometheus.monitoring:9090."""
    query: str | None = Field(None, max_length=4096)
    """PromQL whose value is the service's waiting requests. Default:
    sum(vllm:num_requests_waiting{namespace="<namespace>",service="<name>"})."""


class AutoscalingSpec(CamelModel):
    """Replicas from queue length. mode builtin: the operator owns the replica count and
    spec.replicas is ignored. mode hpa or keda: the operator emits a HorizontalPodAutoscaler
    or a KEDA ScaledObject that drives spec.replicas through the scale subresource."""

    enabled: bool = False
    mode: Literal["builtin", "hpa", "keda"] = "builtin"
    """Who scales: the operator's own loop, an HPA on the external metric
    vllm:num_requests_waiting (needs an external metrics adapter), or KEDA."""
    min_replicas: int = Field(1, ge=0, le=1000)
    """0 scales an idle service to zero (modes builtin and keda): in builtin mode after
    scaleToZeroAfterSeconds without a request, with the activator holding the requests
    that arrive at zero; in keda mode by KEDA's own activation."""
    max_replicas: int = Field(4, ge=1, le=1000)
    scale_to_zero_after_seconds: int = Field(300, ge=60, le=86400)
    """With minReplicas 0 in builtin mode: how long no replica may run, queue or generate
    anything before the service scales to zero."""
    target_queue_length: float = Field(4.0, gt=0, le=100_000)
    """Waiting requests per replica to aim for."""
    scale_up_stabilization_seconds: int = Field(30, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=86400)
    keda: KedaSpec = Field(default_factory=KedaSpec)

    rules = (
        Rule(
            cel="self.minReplicas <= self.maxReplicas",
            message="autoscaling.minReplicas must be <= autoscaling.maxReplicas",
            check=lambda a: a.min_replicas <= a.max_replicas,
        ),
        Rule(
            cel="self.minReplicas > 0 || self.mode != 'hpa'",
            message="autoscaling.minReplicas 0 needs mode builtin or keda (an HPA cannot "
            "scale to zero)",
            check=lambda a: a.min_replicas > 0 or a.mode != "hpa",
        ),
        Rule(
            cel="self.mode != 'keda' || has(self.keda.serverAddress)",
            message="autoscaling.keda.serverAddress is required with mode keda",
            check=lambda a: a.mode != "keda" or a.keda.server_address is not None,
        ),
    )

    @property
    def builtin(self) -> bool:
        """Does the operator's own loop set the replica count?"""
        return self.enabled and self.mode == "builtin"
