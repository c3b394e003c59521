"""The InferenceService's spec, its cross-field rules, and its parsing."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationError

from batchpilot.operator import flags
from batchpilot.operator.crd.autoscaling import AutoscalingSpec
from batchpilot.operator.crd.base import CamelModel, Rule
from batchpilot.operator.crd.engine import (
    MAX_ADAPTERS,
    AdapterResolverSpec,
    AdapterSpec,
    EngineSpec,
    ModelSpec,
    ServerSpec,
)
from batchpilot.operator.crd.pod import PodSpec, ResourceRequirements
from batchpilot.operator.crd.routing import RoutingSpec
from batchpilot.operator.crd.tuning import SLOSpec, TuningSpec

# RoutingSpec.precise_prefix in CEL: the picker the operator deploys reads KV-cache events.
_EPP = "self.routing.endpointPicker"
PRECISE_PREFIX_CEL = (
    f"self.routing.inferencePool && has({_EPP}) && ({_EPP}.deploy || has({_EPP}.image)) && "
    f"{_EPP}.scorers.prefixCache.mode == 'precise' && {_EPP}.scorers.prefixCache.weight > 0"
)


class InferenceServiceSpec(CamelModel):
    model: ModelSpec = Field(default_factory=ModelSpec)
    """The model to serve."""
    image: str | None = Field(None, max_length=512)
    """The server image. Default: the operator's (--server-image or BATCHPILOT_SERVER_IMAGE;
    the release's batchpilot-server image otherwise)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    replicas: int = Field(1, ge=0, le=1000)
    """Replicas while autoscaling is off (the scale subresource)."""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    server: ServerSpec = Field(default_factory=ServerSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    slo: SLOSpec = Field(default_factory=SLOSpec)
    tuning: TuningSpec = Field(default_factory=TuningSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    pod: PodSpec = Field(default_factory=PodSpec)
    adapters: list[AdapterSpec] = Field(default_factory=list, max_length=MAX_ADAPTERS)
    """LoRA adapters to serve. Adding or removing one loads or unloads it on every
    replica without a restart (status.adapters has each one's state per replica)."""
    adapter_resolver: AdapterResolverSpec | None = None
    """A directory of adapters each replica loads on first use, by the name a request
    sends (vLLM's filesystem LoRA resolver). Setting or changing it rolls the pods."""

    rules = (
        Rule(
            cel=f"!({PRECISE_PREFIX_CEL}) || {flags.KV_EVENTS_CEL}",
            message=f"engine.extraArgs may not set {flags.KV_EVENTS_CONFIG} while the "
            "deployed endpoint picker's prefix scorer is precise: the operator renders it",
            check=lambda s: (
                not s.routing.precise_prefix or not flags.sets_kv_events(s.engine.extra_args)
            ),
        ),
        Rule(
            cel="!has(self.adapters) || self.adapters.all(a, "
            "self.adapters.exists_one(b, b.name == a.name))",
            message="adapters: each name may appear once",
            check=lambda s: len({a.name for a in s.adapters}) == len(s.adapters),
        ),
        Rule(
            cel="!has(self.adapters) || !has(self.model.name) || "
            "!self.adapters.exists(a, a.name == self.model.name)",
            message="adapters: an adapter may not be named like the model (model.name)",
            check=lambda s: s.model.name is None or all(a.name != s.model.name for a in s.adapters),
        ),
        Rule(
            cel="!has(self.tuning.maxLoras) || (self.tuning.maxLoras.min <= self.engine.maxLoras"
            " && self.engine.maxLoras <= self.tuning.maxLoras.max)",
            message="engine.maxLoras must lie within tuning.maxLoras.min..max",
            check=lambda s: (
                s.tuning.max_loras is None
                or s.tuning.max_loras.min <= s.engine.max_loras <= s.tuning.max_loras.max
            ),
        ),
        Rule(
            cel="!self.tuning.enabled || (self.tuning.maxNumSeqs.min <= self.engine.maxNumSeqs"
            " && self.engine.maxNumSeqs <= self.tuning.maxNumSeqs.max)",
            message="with tuning enabled, engine.maxNumSeqs must lie within "
            "tuning.maxNumSeqs.min..max",
            check=lambda s: (
                not s.tuning.enabled
                or s.tuning.max_num_seqs.min <= s.engine.max_num_seqs <= s.tuning.max_num_seqs.max
            ),
        ),
        Rule(
            cel="!has(self.tuning.maxNumBatchedTokens) || !has(self.engine.maxNumBatchedTokens)"
            " || (self.tuning.maxNumBatchedTokens.min <= self.engine.maxNumBatchedTokens"
            " && self.engine.maxNumBatchedTokens <= self.tuning.maxNumBatchedTokens.max)",
            message="engine.maxNumBatchedTokens must lie within "
            "tuning.maxNumBatchedTokens.min..max",
            check=lambda s: (
                s.tuning.max_num_batched_tokens is None
                or s.engine.max_num_batched_tokens is None
                or s.tuning.max_num_batched_tokens.min
                <= s.engine.max_num_batched_tokens
                <= s.tuning.max_num_batched_tokens.max
            ),
        ),
        Rule(
            cel="!has(self.tuning.maxNumBatchedTokens) || self.engine.enableChunkedPrefill"
            " || !has(self.engine.maxModelLen)"
            " || self.tuning.maxNumBatchedTokens.min >= self.engine.maxModelLen",
            message="tuning.maxNumBatchedTokens.min must be >= engine.maxModelLen unless "
            "engine.enableChunkedPrefill is true: a full-length prompt would never fit in "
            "one step",
            check=lambda s: (
                s.tuning.max_num_batched_tokens is None
                or s.engine.enable_chunked_prefill
                or s.engine.max_model_len is None
                or s.tuning.max_num_batched_tokens.min >= s.engine.max_model_len
            ),
        ),
    )

    @property
    def itl_target_seconds(self) -> float:
        """The inter-token latency target: spec.slo's, else the tuner's older field."""
        slo = self.slo.inter_token_latency_seconds
        return slo if slo is not None else self.tuning.target_inter_token_latency_seconds

    @property
    def ttft_target_seconds(self) -> float:
        return self.slo.time_to_first_token_seconds


# --------------------------------------------------------------------------- parsing

# The object's name names its Service, so it must be a DNS-1035 label.
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX = 63
NAME_RULE = {
    "rule": f"size(self.metadata.name) <= {NAME_MAX} && self.metadata.name.matches('{NAME_PATTERN}')",
    "message": "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', "
    f"starting with a letter, at most {NAME_MAX} characters): it names the Service",
}


def check_name(name: str) -> None:
    if len(name) > NAME_MAX or not re.match(NAME_PATTERN, name):
        raise SpecError(NAME_RULE["message"])


class SpecError(ValueError):
    """A spec that does not validate; ``str()`` is one line per problem, with field paths."""


def parse_spec(spec: dict | None) -> InferenceServiceSpec:
    try:
        return InferenceServiceSpec.model_validate(dict(spec or {}))
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"spec.{loc}: {msg}" if loc else f"spec: {msg}")
        raise SpecError("; ".join(lines)) from None
