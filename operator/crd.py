"""The InferenceService API (group batchpilot.dev, version v1alpha1), defined once.

The pydantic models below are the single source of the schema:

- the operator parses every object's spec with them (typed access, the same defaults the
  API server applies, and the same cross-field rules as the CRD's CEL);
- ``crd_manifest()`` walks them into the CRD's structural OpenAPI v3 schema, and
  ``batchpilot operator crds`` writes it to ``crds/`` (a test fails when that file is stale).

Field docstrings become the schema's descriptions (``kubectl explain bpis.spec.engine``).
Cross-field rules are declared once as ``Rule(cel, message, check)``: the CEL goes into
``x-kubernetes-validations`` and ``check`` is the same predicate in Python.
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import annotated_types
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from batchpilot import names
from batchpilot.operator import flags

GROUP = "batchpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["bpis"]  # "isvc" belongs to KServe
CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
    "SpecError",
    "crd_manifest",
    "parse_spec",
]


# --------------------------------------------------------------------------- schema hints


@dataclass(frozen=True, eq=False)  # eq=False: hashable by identity, as Annotated needs
class K8sSchema:
    """``Annotated[..., K8sSchema({...})]``: use this OpenAPI fragment for the type as is."""

    schema: dict


@dataclass(frozen=True)
class Rule:
    """A cross-field rule, stated once for the API server (CEL) and for Python (check)."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None


_QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[
    int | str,
    K8sSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": _QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
# Opaque core/v1 objects (affinity, volumes, ...): kept as given, validated by the API server
# when the operator applies the Deployment.
Opaque = Annotated[
    dict[str, Any], K8sSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]
DNS1123Subdomain = Annotated[
    str,
    Field(
        max_length=253, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
    ),
]


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        use_attribute_docstrings=True,
        validate_default=True,
        frozen=True,
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self):
        for rule in type(self).rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

    def to_api(self) -> dict:
        """The object as the API server stores it (camelCase, defaults filled, None dropped)."""
        return self.model_dump(by_alias=True, exclude_none=True)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


class _Camel(_Model):
    model_config = ConfigDict(alias_generator=_camel)


# --------------------------------------------------------------------------- spec


# A path in the container, a path on a PersistentVolumeClaim, or a pre-cached HF repo.
_SOURCE_FORMS = r"/.+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|hf://[^/\s]+/[^\s]+"


class ModelSpec(_Camel):
    source: str = Field("bundled", max_length=1024, pattern=rf"^(bundled|{_SOURCE_FORMS})$")
    """Where the weights come from: `bundled` (SmolLM2-135M-Instruct inside the server image),
    an absolute path in the container (an HF directory, safetensors or a .gguf file),
    `pvc://<claim>/<path>` (the claim is mounted read-only; the operator checks it exists),
    or `hf://<org>/<name>` (already in the image's or a mounted Hugging Face cache)."""

    name: DNS1123Subdomain | None = None
    """The model name clients send (`model` in OpenAI requests) and the `model_name` metric
    label. Default: smollm2-135m-instruct for the bundled model, else the source's last
    path component."""


class EngineSpec(_Camel):
    """Engine settings. Each field has the name of the server's flag (vLLM's names)."""

    max_model_len: int | None = Field(None, ge=16, le=1 << 20, alias=names.MAX_MODEL_LEN.crd_field)
    """Longest prompt plus output, in tokens. Default: the model's limit, capped at 4096."""

    max_num_seqs: int = Field(64, ge=1, le=4096, alias=names.MAX_NUM_SEQS.crd_field)
    """Most sequences in one batch. The tuner changes it live within tuning.maxNumSeqs."""

    max_num_batched_tokens: int | None = Field(
        None, ge=1, le=1 << 20, alias=names.MAX_NUM_BATCHED_TOKENS.crd_field
    )
    """Token budget of one engine step. Default with chunked prefill: 2048 on GPUs, 512
    on CPUs; without it, at least maxModelLen."""

    kv_cache_dtype: Literal[names.KV_CACHE_DTYPES] = Field(  # type: ignore[valid-type]
        "auto", alias=names.KV_CACHE_DTYPE.crd_field
    )
    """KV-cache element type: auto (the model's dtype) or an fp8 format (half the memory)."""

    gpu_memory_utilization: float = Field(
        0.9, ge=0.1, le=0.99, alias=names.GPU_MEMORY_UTILIZATION.crd_field
    )
    """Fraction of GPU memory the engine may use for weights, activations and KV cache."""

    swap_space_gib: float = Field(4.0, ge=0, le=1024, alias=names.SWAP_SPACE.crd_field)
    """CPU swap space for preempted sequences' KV blocks, in GiB."""

    block_size: Literal[1, 2, 4, 8, 16, 32, 64, 128] = Field(16, alias=names.BLOCK_SIZE.crd_field)
    """Tokens per KV-cache block."""

    preemption_mode: Literal[names.PREEMPTION_MODES] = Field(  # type: ignore[valid-type]
        "swap", alias=names.PREEMPTION_MODE.crd_field
    )
    """What happens to a preempted sequence's KV blocks: swap them to CPU, or drop and
    recompute them."""

    enable_chunked_prefill: bool = Field(True, alias=names.ENABLE_CHUNKED_PREFILL.crd_field)
    """Split long prompts across steps so that decodes keep flowing."""

    enable_prefix_caching: bool = Field(True, alias=names.ENABLE_PREFIX_CACHING.crd_field)
    """Reuse KV blocks of identical prompt prefixes."""

    dtype: Literal[names.DTYPES] = "auto"  # type: ignore[valid-type]
    """Weights and activations dtype."""

    enable_lora: bool = False
    """Serve LoRA adapters even while spec.adapters is empty, so that the first adapter
    added later loads live instead of rolling the pods. Implied by a non-empty
    spec.adapters."""

    max_loras: int = Field(1, ge=1, le=64, alias=names.MAX_LORAS.crd_field)
    """Most adapters one batch may use at once (GPU slots). Requests for another adapter
    wait until a slot frees. The tuner raises it within tuning.maxLoras."""

    max_lora_rank: Literal[flags.LORA_RANKS] = Field(  # type: ignore[valid-type]
        16, alias=names.MAX_LORA_RANK.crd_field
    )
    """Largest adapter rank the slots are sized for; a higher-rank adapter fails to load."""

    max_cpu_loras: int | None = Field(None, ge=1, le=1024, alias=names.MAX_CPU_LORAS.crd_field)
    """Adapters kept in CPU memory, loaded or not into a slot. Default: maxLoras."""

    extra_args: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list, max_length=64
    )
    """More `batchpilot serve` flags, appended as given. Flags the operator derives from
    this spec (model, engine settings, ports, shutdown timeout, admin token) may not be set
    here, nor abbreviated."""

    rules = (
        Rule(
            cel=flags.EXTRA_ARGS_CEL,
            message=flags.EXTRA_ARGS_MESSAGE,
            check=lambda e: not any(flags.overrides_managed(a) for a in e.extra_args),
            field_path=".extraArgs",
        ),
        Rule(
            cel="!has(self.maxNumBatchedTokens) || !has(self.maxModelLen) || "
            "self.enableChunkedPrefill || self.maxNumBatchedTokens >= self.maxModelLen",
            message="maxNumBatchedTokens must be >= maxModelLen unless enableChunkedPrefill "
            "is true: a full-length prompt would never fit in one step",
            check=lambda e: (
                e.max_num_batched_tokens is None
                or e.max_model_len is None
                or e.enable_chunked_prefill
                or e.max_num_batched_tokens >= e.max_model_len
            ),
        ),
        Rule(
            cel="!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras",
            message="maxCpuLoras must be >= maxLoras: every adapter in a slot is also held "
            "in CPU memory",
            check=lambda e: e.max_cpu_loras is None or e.max_cpu_loras >= e.max_loras,
        ),
    )


class ServerSpec(_Camel):
    """The server process around the engine."""

    shutdown_timeout_seconds: int = Field(30, ge=1, le=3600)
    """How long SIGTERM waits for in-flight requests (the server's --shutdown-timeout). The
    pod's terminationGracePeriodSeconds is derived from it and preStopSleepSeconds."""

    pre_stop_sleep_seconds: int = Field(5, ge=0, le=300)
    """Pause before SIGTERM so that endpoints drop the pod before it stops accepting."""

    max_queue_len: int = Field(1024, ge=1, le=1_000_000)
    """Waiting requests beyond this get 429 with Retry-After (the server's --max-queue-len)."""


class KedaSpec(_Camel):
    """The KEDA ScaledObject's Prometheus trigger (autoscaling.mode: keda)."""

    server_address: str | None = Field(None, max_length=1024, pattern=r"^https?://\S+$")
    """The Prometheus that scrapes the servers, e.g. http://prometheus.monitoring:9090."""
    query: str | None = Field(None, max_length=4096)
    """PromQL whose value is the service's waiting requests. Default:
    sum(vllm:num_requests_waiting{namespace="<namespace>",service="<name>"})."""


class AutoscalingSpec(_Camel):
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


class IntRange(_Camel):
    min: int = Field(8, ge=1, le=4096)
    max: int = Field(256, ge=1, le=4096)

    rules = (
        Rule(
            cel="self.min <= self.max",
            message="tuning.maxNumSeqs.min must be <= tuning.maxNumSeqs.max",
            check=lambda r: r.min <= r.max,
        ),
    )


class TokenRange(_Camel):
    """Bounds of a step budget, in tokens."""

    min: int = Field(ge=1, le=1 << 20)
    max: int = Field(ge=1, le=1 << 20)

    rules = (
        Rule(
            cel="self.min <= self.max",
            message="tuning.maxNumBatchedTokens.min must be <= tuning.maxNumBatchedTokens.max",
            check=lambda r: r.min <= r.max,
        ),
    )


class LoraRange(_Camel):
    """Bounds of max_loras, the adapters one batch may use at once."""

    min: int = Field(ge=1, le=64)
    max: int = Field(ge=1, le=64)

    rules = (
        Rule(
            cel="self.min <= self.max",
            message="tuning.maxLoras.min must be <= tuning.maxLoras.max",
            check=lambda r: r.min <= r.max,
        ),
    )


class TuningSpec(_Camel):
    """The online tuner of max_num_seqs, max_num_batched_tokens and the KV-cache dtype."""

    enabled: bool = False
    max_num_seqs: IntRange = Field(default_factory=IntRange)
    """Bounds the tuner keeps max_num_seqs within."""
    max_num_batched_tokens: TokenRange | None = Field(
        None, alias=names.MAX_NUM_BATCHED_TOKENS.crd_field
    )
    """Bounds the tuner keeps the step budget (max_num_batched_tokens) within; it changes
    live. Pods start with the max (the budget the engine profiles its memory at) and get the
    tuned value once up. Default: not tuned."""
    max_loras: LoraRange | None = Field(None, alias=names.MAX_LORAS.crd_field)
    """Bounds the tuner keeps max_loras within: raised when requests wait for adapters
    that find no free slot while batch slots are free. A change rolls the pods. Default:
    not tuned."""
    allow_fp8_kv_cache: bool = Field(False, alias="allowFP8KVCache")
    """May the tuner switch the KV cache to fp8 and back: to fp8 when memory-bound, back
    when fp8 does not pay (each switch is a rolling restart)."""
    target_inter_token_latency_seconds: float = Field(0.1, gt=0, le=60)
    """P99 inter-token latency above this lowers max_num_seqs.
    spec.slo.interTokenLatencySeconds, when set, takes precedence."""
    cooldown_seconds: int = Field(120, ge=0, le=86400)
    """Least time between two tuning decisions."""


class SLOSpec(_Camel):
    """The service's latency targets. Goodput counts the tokens of the requests that meet
    both."""

    time_to_first_token_seconds: float = Field(2.0, gt=0, le=600)
    """Time to first token a request should see, at most."""
    inter_token_latency_seconds: float | None = Field(None, gt=0, le=60)
    """Time between two output tokens a request should see, at most. Default:
    tuning.targetInterTokenLatencySeconds."""


class EndpointPickerSpec(_Camel):
    """The Gateway API Inference Extension endpoint picker (EPP) that routes for the pool: a
    Service the user runs (GIE's own EPP or another implementation of its protocol)."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """The EPP's Service, in the InferenceService's namespace."""
    port: int = Field(9002, ge=1, le=65535)
    """The Service's port for the ext-proc gRPC stream (GIE's default 9002)."""
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """What the gateway does when the EPP does not answer: FailClose refuses the request,
    FailOpen sends it to any pod of the pool."""


class RoutingSpec(_Camel):
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


class Toleration(_Camel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(_Camel):
    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: Opaque | None = None


class LocalObjectReference(_Camel):
    name: str


# The volume sources the restricted Pod Security Standard admits: hostPath and the other
# node-level sources are refused by the CRD, whatever the namespace enforces.
VOLUME_SOURCES = (
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
)
# A core/v1 Volume with only these sources declared: any other source (hostPath...) is an
# unknown field, refused by strict field validation or pruned, and then the volume has no
# source and fails the rule below. The API server validates each source's body when the
# operator applies the Deployment.
Volume = Annotated[
    dict[str, Any],
    K8sSchema(
        {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "maxLength": 63},
                **{
                    s: {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    for s in VOLUME_SOURCES
                },
            },
        }
    ),
]
_ONE_VOLUME_SOURCE_CEL = (
    "[" + ", ".join(f"has(v.{s})" for s in VOLUME_SOURCES) + "].filter(b, b).size() == 1"
)


def _one_allowed_source(volume: dict) -> bool:
    keys = set(volume) - {"name"}
    return len(keys) == 1 and keys <= set(VOLUME_SOURCES)


class PodSpec(_Camel):
    """Pass-through settings of the server pods (core/v1 names and shapes). The security
    context is the operator's (the restricted Pod Security Standard) and cannot be set."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    affinity: Opaque | None = None
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    service_account_name: DNS1123Subdomain | None = None
    """A ServiceAccount of the namespace for the pods. Only one labelled
    batchpilot.dev/inference-server=allowed: whoever may label ServiceAccounts decides which
    ones InferenceServices may run as. Default: the namespace's default, with no API token
    mounted."""
    annotations: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    priority_class_name: str | None = None
    volumes: list[Volume] = Field(default_factory=list, max_length=64)
    """Extra volumes, e.g. a Hugging Face cache for hf:// sources: configMap, csi,
    downwardAPI, emptyDir, ephemeral, image, persistentVolumeClaim, projected or secret
    (what the restricted Pod Security Standard admits; never hostPath)."""
    volume_mounts: list[Opaque] = Field(default_factory=list, max_length=64)
    """Mounts of the extra volumes into the server container."""

    rules = (
        Rule(
            cel=f"!has(self.volumes) || self.volumes.all(v, {_ONE_VOLUME_SOURCE_CEL})",
            message="pod.volumes: each volume needs exactly one source, of "
            + ", ".join(VOLUME_SOURCES)
            + " (the restricted Pod Security Standard's list; hostPath and other node "
            "volumes are refused)",
            check=lambda p: all(_one_allowed_source(v) for v in p.volumes),
            field_path=".volumes",
        ),
    )


# vLLM accepts any model id as an adapter's name; bounded here to what reads well in a
# label, a metric and a URL: letters, digits, '-', '_', '.', starting and ending with one
# of the first two.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
MAX_ADAPTERS = 32


class AdapterSpec(_Camel):
    """A LoRA adapter served beside the base model, loaded into every replica live."""

    name: str = Field(min_length=1, max_length=63, pattern=ADAPTER_NAME_PATTERN)
    """The model name clients send (`model` in OpenAI requests) to use the adapter."""
    source: str = Field(max_length=1024, pattern=rf"^({_SOURCE_FORMS})$")
    """Where the adapter (a PEFT directory) is: an absolute path in the container,
    `pvc://<claim>/<path>` (mounted read-only; a claim not mounted yet rolls the pods), or
    `hf://<org>/<name>` (already in a mounted Hugging Face cache)."""


class ResourceRequirements(_Camel):
    """core/v1 ResourceRequirements of the server container, e.g. limits nvidia.com/gpu: 1."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)


class InferenceServiceSpec(_Camel):
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

    rules = (
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


# --------------------------------------------------------------------------- status


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Camel):
    model_config = ConfigDict(extra="ignore")
    type: str = Field(max_length=316)
    status: ConditionStatus
    reason: str = Field("", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    observed_generation: int | None = None


class EngineStatus(_Camel):
    """Engine settings in force in the serving pod template."""

    model_config = ConfigDict(extra="ignore")
    max_num_seqs: int | None = Field(None, alias=names.MAX_NUM_SEQS.crd_field)
    kv_cache_dtype: str | None = Field(None, alias=names.KV_CACHE_DTYPE.crd_field)
    max_num_batched_tokens: int | None = Field(None, alias=names.MAX_NUM_BATCHED_TOKENS.crd_field)
    max_model_len: int | None = Field(None, alias=names.MAX_MODEL_LEN.crd_field)
    preemption_mode: str | None = Field(None, alias=names.PREEMPTION_MODE.crd_field)
    block_size: int | None = Field(None, alias=names.BLOCK_SIZE.crd_field)
    gpu_memory_utilization: float | None = Field(None, alias=names.GPU_MEMORY_UTILIZATION.crd_field)
    swap_space_gib: float | None = Field(None, alias=names.SWAP_SPACE.crd_field)
    enable_chunked_prefill: bool | None = Field(None, alias=names.ENABLE_CHUNKED_PREFILL.crd_field)
    enable_prefix_caching: bool | None = Field(None, alias=names.ENABLE_PREFIX_CACHING.crd_field)
    max_loras: int | None = Field(None, alias=names.MAX_LORAS.crd_field)
    max_lora_rank: int | None = Field(None, alias=names.MAX_LORA_RANK.crd_field)
    max_cpu_loras: int | None = Field(None, alias=names.MAX_CPU_LORAS.crd_field)


AdapterState = Literal["Loading", "Loaded", "Failed", "Unloading"]
MAX_ADAPTER_REPLICAS_SHOWN = 32


class AdapterReplicaStatus(_Camel):
    """One replica's state of an adapter."""

    model_config = ConfigDict(extra="ignore")
    pod: str = Field(max_length=253)
    """The pod (or, with --metrics-urls, the replica's URL)."""
    state: AdapterState
    """Loading: not confirmed loaded yet (the replica has not been reached); Loaded;
    Failed: the replica refused it (message says why; retried later); Unloading: removed
    from the spec, still loaded there (requests for it in flight)."""
    message: str = Field("", max_length=1024)
    time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    """When the state was last set."""


class AdapterStatus(_Camel):
    """An adapter of the spec, or one removed from it and still being unloaded."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(max_length=63)
    path: str = Field("", max_length=1024)
    """The path the replicas were sent (in the container)."""
    loaded: int = 0
    """Replicas serving it."""
    replicas: list[AdapterReplicaStatus] = Field(
        default_factory=list, max_length=MAX_ADAPTER_REPLICAS_SHOWN
    )
    """Per replica, Failed ones first, at most 32."""


class InferenceServiceStatus(_Camel):
    model_config = ConfigDict(extra="ignore")
    observed_generation: int | None = None
    replicas: int | None = None
    """Pods of the serving Deployment (the scale subresource's status replicas)."""
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    selector: str | None = None
    """Label selector of the serving pods (the scale subresource's selector)."""
    url: str | None = None
    """In-cluster base URL: the Service's cluster DNS name and port."""
    image: str | None = None
    """The server image in force."""
    engine: EngineStatus | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    metrics: Opaque | None = None
    """Windowed per-service metrics (written by the autoscaler and tuner loops)."""
    autoscaling: Opaque | None = None
    """The autoscaler's latest decision and its reason."""
    tuning: Opaque | None = None
    """The tuner's latest decision, its reason and a bounded history."""
    adapters: list[AdapterStatus] | None = Field(None, max_length=2 * MAX_ADAPTERS)
    """Each LoRA adapter's state per replica."""


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


# --------------------------------------------------------------------------- schema walker


def _schema_for(annotation: Any, metadata: list, extra: dict | None) -> dict:
    hinted = any(isinstance(m, K8sSchema) for m in metadata)
    out = {} if hinted else _schema_for_type(annotation)
    for m in metadata:
        out.update(_constraint(m, out))
    if extra:
        out.update(extra)
    return out


def _constraint(m: Any, out: dict) -> dict:
    is_array = out.get("type") == "array"
    is_object = out.get("type") == "object"
    match m:
        case annotated_types.Ge(ge=v):
            return {"minimum": v}
        case annotated_types.Le(le=v):
            return {"maximum": v}
        case annotated_types.Gt(gt=v):
            return {"minimum": v, "exclusiveMinimum": True}
        case annotated_types.Lt(lt=v):
            return {"maximum": v, "exclusiveMaximum": True}
        case annotated_types.MinLen(min_length=v):
            key = "minItems" if is_array else "minProperties" if is_object else "minLength"
            return {key: v}
        case annotated_types.MaxLen(max_length=v):
            key = "maxItems" if is_array else "maxProperties" if is_object else "maxLength"
            return {key: v}
        case K8sSchema(schema=s):
            return dict(s)
    pattern = getattr(m, "pattern", None)
    if pattern is not None:
        return {"pattern": pattern}
    raise TypeError(f"unsupported constraint in the CRD schema: {m!r}")


def _schema_for_type(tp: Any) -> dict:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        base, *meta = args
        flat = []
        for m in meta:  # Annotated[str, Field(...)] carries a FieldInfo
            flat.extend(m.metadata if isinstance(m, FieldInfo) else [m])
        return _schema_for(base, flat, None)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unions other than Optional need a K8sSchema hint: {tp!r}")
        return _schema_for_type(rest[0])
    if origin is Literal:
        kinds = {type(a) for a in args}
        if kinds == {str}:
            return {"type": "string", "enum": list(args)}
        if kinds == {int}:
            return {"type": "integer", "enum": list(args)}
        raise TypeError(f"mixed Literal: {tp!r}")
    if origin is list:
        return {"type": "array", "items": _schema_for_type(args[0])}
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"map keys must be str: {tp!r}")
        if args[1] is Any:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "object", "additionalProperties": _schema_for_type(args[1])}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return model_schema(tp)
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    raise TypeError(f"unsupported type in the CRD schema: {tp!r}")


def _prune_empty(value: Any) -> Any:
    if isinstance(value, dict):
        pruned = {k: _prune_empty(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in ({}, [])}
    return value


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def model_schema(model: type[BaseModel]) -> dict:
    """The structural OpenAPI v3 schema of a pydantic model (no $ref, no nulls)."""
    props: dict[str, dict] = {}
    required: list[str] = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        extra = info.json_schema_extra
        schema = _schema_for(info.annotation, list(info.metadata), extra)  # type: ignore[arg-type]
        if info.description:  # the field's docstring wins over its type's
            schema = {"description": " ".join(info.description.split())} | {
                k: v for k, v in schema.items() if k != "description"
            }
        if info.default is not PydanticUndefined and info.default is not None:
            schema["default"] = info.default
        elif info.default_factory is not None and _is_model(info.default_factory):
            # Expanded: the API server checks a default against the CEL rules as it stands,
            # before nested defaulting.
            schema["default"] = _prune_empty(info.default_factory().to_api())
        elif info.is_required():
            required.append(key)
        props[key] = schema
    out: dict[str, Any] = {}
    doc = model.__dict__.get("__doc__")
    if doc:
        out["description"] = " ".join(doc.split())
    out["type"] = "object"
    out["properties"] = props
    if required:
        out["required"] = required
    rules = getattr(model, "rules", ())
    if rules:
        out["x-kubernetes-validations"] = [
            {"rule": r.cel, "message": r.message}
            | ({"fieldPath": r.field_path} if r.field_path else {})
            for r in rules
        ]
    return out


# --------------------------------------------------------------------------- manifests


def printer_columns() -> list[dict]:
    return [
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        },
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
        # The settings the Deployment records: the tuner's too (max_num_seqs live).
        {"name": "MaxNumSeqs", "type": "integer", "jsonPath": ".status.engine.maxNumSeqs"},
        {"name": "KV", "type": "string", "jsonPath": ".status.engine.kvCacheDtype"},
        {"name": "URL", "type": "string", "jsonPath": ".status.url"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def _version_schema() -> dict:
    return {
        "description": "An OpenAI-compatible LLM inference service: a Deployment of "
        "batchpilot servers that the operator scales and tunes.",
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {
                **model_schema(InferenceServiceSpec),
                "default": _prune_empty(InferenceServiceSpec().to_api()),
            },
            "status": model_schema(InferenceServiceStatus),
        },
        "x-kubernetes-validations": [NAME_RULE],
    }


def crd_manifest() -> dict:
    """The InferenceService CustomResourceDefinition."""
    version = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": _version_schema()},
        "subresources": {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
        "additionalPrinterColumns": printer_columns(),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {
                "app.kubernetes.io/name": "batchpilot",
                "app.kubernetes.io/part-of": "batchpilot",
            },
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["batchpilot"],
            },
            "versions": [version],
        },
    }


def peering_crds() -> list[dict]:
    """Kopf's peering CRDs: an operator with --peering keeps a standby replica paused."""
    out = []
    for scope, kind, plural in (
        ("Cluster", "ClusterKopfPeering", "clusterkopfpeerings"),
        ("Namespaced", "KopfPeering", "kopfpeerings"),
    ):
        out.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.kopf.dev"},
                "spec": {
                    "scope": scope,
                    "group": "kopf.dev",
                    "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "properties": {
                                        "status": {
                                            "type": "object",
                                            "x-kubernetes-preserve-unknown-fields": True,
                                        }
                                    },
                                }
                            },
                        }
                    ],
                },
            }
        )
    return out


_HEADER = "# Generated by `batchpilot operator crds` from operator/crd.py. Do not edit.\n"


def render(manifests: dict | list[dict]) -> str:
    docs = manifests if isinstance(manifests, list) else [manifests]
    docs = json.loads(json.dumps(docs))  # no shared sub-dicts: YAML without anchors
    body = "---\n".join(yaml.safe_dump(d, sort_keys=False, width=100) for d in docs)
    return _HEADER + body


def rendered_files() -> dict[str, str]:
    """File name -> content of everything under crds/."""
    return {
        CRD_FILE: render(crd_manifest()),
        "kopf-peering.yaml": render(peering_crds()),
    }


def write_crds(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered_files().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
