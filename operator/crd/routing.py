"""spec.routing: an InferencePool and its endpoint picker, besides the Service."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from batchpilot.operator.crd.base import CamelModel, Rule
from batchpilot.operator.crd.pod import ResourceRequirements


class PrefixCacheScorerSpec(CamelModel):
    """Scores each pod by how much of the prompt's prefix it holds in its KV cache."""

    weight: int = Field(3, ge=0, le=100)
    """Its weight in the profile (GIE's default 3); 0 leaves it out."""
    mode: Literal["approximate", "precise"] = "approximate"
    """approximate: GIE's prefix-cache-scorer, which remembers where it sent each prefix
    and needs nothing from the server beyond vllm:cache_config_info. precise: llm-d's
    precise-prefix-cache-scorer, which indexes the KV-cache events every replica publishes
    (the operator then renders --kv-events-config on the server pods); needs llm-d's
    inference-scheduler image."""
    auto_tune: bool = True
    """approximate: size the index from each pod's vllm:cache_config_info (block size and
    KV blocks); false uses engine.blockSize and lruCapacityPerServer instead."""
    max_prefix_blocks: int = Field(256, ge=1, le=65536)
    """approximate: the most prefix blocks matched (GIE's maxPrefixBlocksToMatch)."""
    lru_capacity_per_server: int = Field(31250, ge=1, le=10_000_000)
    """approximate, autoTune off: blocks remembered per pod (GIE's lruCapacityPerServer)."""


class ScorersSpec(CamelModel):
    """The scheduling profile's scorers and their weights, GIE's defaults by default; a
    weight of 0 leaves a scorer out."""

    prefix_cache: PrefixCacheScorerSpec = Field(default_factory=PrefixCacheScorerSpec)
    queue_weight: int = Field(2, ge=0, le=100)
    """queue-scorer (vllm:num_requests_waiting): the shorter queue wins."""
    kv_cache_utilization_weight: int = Field(2, ge=0, le=100)
    """kv-cache-utilization-scorer (vllm:kv_cache_usage_perc): the emptier cache wins."""
    lora_affinity_weight: int = Field(1, ge=0, le=100)
    """lora-affinity-scorer (vllm:lora_requests_info): a pod with the request's adapter
    loaded wins. Rendered only while LoRA is on (adapters, adapterResolver, enableLora)."""


LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def _label(name: str) -> bool:
    return len(name) <= 63 and re.match(LABEL_PATTERN, name) is not None


def _deploys(e: EndpointPickerSpec) -> bool:
    return e.deploy or e.image is not None


class EndpointPickerSpec(CamelModel):
    """The Gateway API Inference Extension endpoint picker (EPP) that routes for the pool:
    a Service the user runs (name), or one the operator runs for the service (deploy)."""

    name: str | None = Field(
        None, min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
    )
    """The EPP's Service, in the InferenceService's namespace. Required unless deploy; a
    deployed picker's objects are all named so (a DNS-1035 label then), `<service>-epp`
    by default."""
    port: int = Field(9002, ge=1, le=65535)
    """The Service's port for the ext-proc gRPC stream (GIE's default 9002)."""
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """What the gateway does when the EPP does not answer: FailClose refuses the request,
    FailOpen sends it to any pod of the pool."""
    deploy: bool = False
    """Run the picker: a Deployment of image with its ConfigMap, Service, ServiceAccount,
    Role and RoleBinding, owned by the InferenceService. Implied by image."""
    image: str | None = Field(None, min_length=1, max_length=512)
    """The EPP image, e.g. registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0;
    prefixCache.mode precise needs llm-d's inference scheduler instead."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    replicas: int = Field(1, ge=1, le=3)
    """More than one runs GIE's leader election: one picks, the others stand by."""
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(requests={"cpu": "250m", "memory": "256Mi"})
    )
    verbosity: int = Field(1, ge=0, le=5)
    """The EPP's log level (-v); 4 logs every scorer's score per pod."""
    scorers: ScorersSpec = Field(default_factory=ScorersSpec)

    rules = (
        Rule(
            cel="has(self.name) || self.deploy || has(self.image)",
            message="routing.endpointPicker: name is required unless the operator deploys it",
            check=lambda e: e.name is not None or _deploys(e),
        ),
        Rule(
            cel="!(self.deploy || has(self.image)) || !has(self.name) || "
            f"(size(self.name) <= 63 && self.name.matches('{LABEL_PATTERN}'))",
            message="routing.endpointPicker.name of a deployed picker must be a DNS-1035 "
            "label (at most 63 characters, no dots): it names its Deployment and Service",
            check=lambda e: not _deploys(e) or e.name is None or _label(e.name),
        ),
        Rule(
            cel="!self.deploy || has(self.image)",
            message="routing.endpointPicker.image is required with deploy",
            check=lambda e: not e.deploy or e.image is not None,
        ),
    )

    @property
    def deployed(self) -> bool:
        return _deploys(self)


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
        Rule(
            cel="self.inferencePool || !has(self.endpointPicker) || "
            "!(self.endpointPicker.deploy || has(self.endpointPicker.image))",
            message="routing.endpointPicker.deploy needs routing.inferencePool: the picker "
            "serves the pool",
            check=lambda r: (
                r.inference_pool or not (r.endpoint_picker and r.endpoint_picker.deployed)
            ),
        ),
    )

    @property
    def picker(self) -> EndpointPickerSpec | None:
        """The endpoint picker the operator runs, if any."""
        epp = self.endpoint_picker
        return epp if self.inference_pool and epp is not None and epp.deployed else None

    @property
    def precise_prefix(self) -> bool:
        """Does the deployed picker read the replicas' KV-cache events?"""
        p = self.picker
        prefix = p.scorers.prefix_cache if p else None
        return prefix is not None and prefix.weight > 0 and prefix.mode == "precise"
