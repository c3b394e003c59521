"""spec.routing: an InferencePool and its endpoint picker, besides the Service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from batchpilot.operator.crd.base import CamelModel, Rule


class EndpointPickerSpec(CamelModel):
    """The Gateway API Inference Extension endpoint picker (EPP) that routes for the pool: a
    Service the user runs (GIE's own EPP or another implementation of its protocol)."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """The EPP's Service, in the InferenceService's namespace."""
    port: int = Field(9002, ge=1, le=65535)
    """The Service's port for the ext-proc gRPC stream (GIE's default 9002)."""
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """What the gateway does when the EPP does not answer: FailClose refuses the request,
    FailOpen sends it to any pod of the pool."""


class RoutingSpec(CamelModel):
    """How traffic reaches the server pods besides their Service."""

    inference_pool: bool = False
    """Emit an InferencePool (inference.networking.k8s.io/v1) named after the service that
    selects its server pods on the serving port, for a Gateway API Inference Extension
    gateway. Needs GIE's CRDs in the cluster and endpointPicker."""
    endpoint_picker: EndpointPickerSpec | None = None

    rules = (
        Rule(
            cel="!self.inferencePool || has(self.endpointPicker)",
            message="routing.endpointPicker is required with routing.inferencePool",
            check=lambda r: not r.inference_pool or r.endpoint_picker is not None,
        ),
    )
