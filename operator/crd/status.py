"""The InferenceService's status: conditions, engine settings in force, adapters."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from batchpilot import names
from batchpilot.operator.crd.base import CamelModel, Opaque
from batchpilot.operator.crd.engine import MAX_ADAPTERS

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(CamelModel):
    model_config = ConfigDict(extra="ignore")
    type: str = Field(max_length=316)
    status: ConditionStatus
    reason: str = Field("", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    observed_generation: int | None = None


class EngineStatus(CamelModel):
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


class AdapterReplicaStatus(CamelModel):
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


class AdapterStatus(CamelModel):
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


class InferenceServiceStatus(CamelModel):
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
