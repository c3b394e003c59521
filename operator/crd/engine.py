"""What each server runs: the model, its LoRA adapters, the engine and the server process."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from batchpilot import names
from batchpilot.operator import flags
from batchpilot.operator.crd.base import CamelModel, DNS1123Subdomain, Quantity, Rule

# A path in the container, a path on a PersistentVolumeClaim, or a pre-cached HF repo.
_DIR_FORMS = r"/.+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?"
_SOURCE_FORMS = _DIR_FORMS + r"|hf://[^/\s]+/[^\s]+"
# A claim is mounted at /models/<claim>, as in pvc:// sources: a DNS-1123 label.
_CLAIM_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class ModelCacheSpec(CamelModel):
    """A PersistentVolumeClaim that a Job fills once per model (source and image) and that
    every replica mounts read-only, loading the model from it."""

    claim_name: str = Field(max_length=63, pattern=_CLAIM_NAME)
    """The claim. Created by the operator when absent (labelled
    app.kubernetes.io/managed-by=batchpilot-operator, with the fields below, and never
    changed or deleted after); one that exists is used as it is."""

    size: Quantity = "10Gi"
    """The storage a created claim requests."""

    storage_class_name: DNS1123Subdomain | None = None
    """The storage class of a created claim. Default: the cluster's default class."""

    access_modes: list[Literal["ReadWriteOnce", "ReadWriteMany"]] = Field(
        default_factory=lambda: ["ReadWriteMany"], min_length=1, max_length=2
    )
    """The access modes of a created claim. ReadWriteMany lets replicas on every node mount
    it; ReadWriteOnce only those on the node that mounted it first."""


class ModelSpec(CamelModel):
    source: str = Field("bundled", max_length=1024, pattern=rf"^(bundled|{_SOURCE_FORMS})$")
    """Where the weights come from: `bundled` (SmolLM2-135M-Instruct inside the server image),
    an absolute path in the container (an HF directory, safetensors or a .gguf file),
    `pvc://<claim>/<path>` (the claim is mounted read-only; the operator checks it exists),
    or `hf://<org>/<name>` (already in the image's or a mounted Hugging Face cache)."""

    name: DNS1123Subdomain | None = None
    """The model name clients send (`model` in OpenAI requests) and the `model_name` metric
    label. Default: smollm2-135m-instruct for the bundled model, else the source's last
    path component."""

    cache: ModelCacheSpec | None = None
    """Fill a claim with the model once and load it from there: replicas start only once
    the fill Job has succeeded (condition ModelCacheReady). Not for pvc:// sources."""

    rules = (
        Rule(
            cel="!has(self.cache) || !self.source.startsWith('pvc://')",
            message="model.cache: a pvc:// source is on a claim already",
            check=lambda m: m.cache is None or not m.source.startswith("pvc://"),
        ),
    )


class EngineSpec(CamelModel):
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


class ServerSpec(CamelModel):
    """The server process around the engine."""

    shutdown_timeout_seconds: int = Field(30, ge=1, le=3600)
    """How long SIGTERM waits for in-flight requests (the server's --shutdown-timeout). The
    pod's terminationGracePeriodSeconds is derived from it and preStopSleepSeconds."""

    pre_stop_sleep_seconds: int = Field(5, ge=0, le=300)
    """Pause before SIGTERM so that endpoints drop the pod before it stops accepting."""

    max_queue_len: int = Field(1024, ge=1, le=1_000_000)
    """Waiting requests beyond this get 429 with Retry-After (the server's --max-queue-len)."""


# label, a metric and a URL: letters, digits, '-', '_', '.', starting and ending with one
# of the first two.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
MAX_ADAPTERS = 32


class AdapterSpec(CamelModel):
    """A LoRA adapter served beside the base model, loaded into every replica live."""

    name: str = Field(min_length=1, max_length=63, pattern=ADAPTER_NAME_PATTERN)
    """The model name clients send (`model` in OpenAI requests) to use the adapter."""
    source: str = Field(max_length=1024, pattern=rf"^({_SOURCE_FORMS})$")
    """Where the adapter (a PEFT directory) is: an absolute path in the container,
    `pvc://<claim>/<path>` (mounted read-only; a claim not mounted yet rolls the pods), or
    `hf://<org>/<name>` (already in a mounted Hugging Face cache)."""


class AdapterResolverSpec(CamelModel):
    """vLLM's filesystem LoRA resolver (VLLM_LORA_RESOLVER_CACHE_DIR): a directory of PEFT
    adapters, one per subdirectory. A request whose `model` names an adapter that is not
    loaded loads `<directory>/<model>/` on first use, so adapters are added by copying them
    to the volume, without touching the InferenceService. The directory reaches the server
    as --lora-resolver-dir; spec.adapters still loads its own on every replica up front."""

    source: str = Field(max_length=1024, pattern=rf"^({_DIR_FORMS})$")
    """The directory: `pvc://<claim>/<path>` (the claim is mounted read-only on every
    replica; a claim that does not exist marks the service Degraded) or an absolute path
    in the container (a volume of pod.volumes)."""
