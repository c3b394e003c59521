"""What the spec asks to run, before any manifest: the model and adapters (paths, claims),
the replicas, and the engine with the loops' decisions applied within the spec's bounds."""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass

from batchpilot import names
from batchpilot.operator.crd.engine import EngineSpec
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.crd.tuning import TokenRange
from batchpilot.operator.loop.state import LoopState

MODEL_MOUNT_ROOT = "/models"
# Bumped when `batchpilot model cache` writes another layout: every cache is filled anew.
CACHE_FORMAT = "1"


@dataclass(frozen=True)
class ModelPlan:
    arg: str  # the server's --model
    served_name: str
    pvc: str | None = None  # claim to mount read-only at MODEL_MOUNT_ROOT/<claim>


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


@dataclass(frozen=True)
class AdapterPlan:
    name: str
    path: str  # what the server's load_lora_adapter is sent
    pvc: str | None = None  # claim mounted read-only at MODEL_MOUNT_ROOT/<claim>


def resolve_source(source: str) -> tuple[str, str | None]:
    """(the path in the container, the claim to mount) of a model or adapter source. A path
    and an hf:// id are the server's to resolve (hf:// from the HF cache, offline)."""
    if not source.startswith("pvc://"):
        return source, None
    claim, _, sub = source.removeprefix("pvc://").partition("/")
    root = f"{MODEL_MOUNT_ROOT}/{claim}"
    path = posixpath.normpath(posixpath.join(root, sub))
    if path != root and not path.startswith(root + "/"):  # "pvc://c/../../etc"
        path = root
    return path, claim


def source_claim(spec: InferenceServiceSpec) -> str | None:
    """The claim of a pvc:// model source (it must exist); None for other sources."""
    return resolve_source(spec.model.source)[1]


def model_claim(spec: InferenceServiceSpec) -> str | None:
    """The claim the replicas load the model from: the cache's, else a pvc:// source's."""
    cache = spec.model.cache
    return cache.claim_name if cache is not None else source_claim(spec)


def cache_key(source: str, image: str) -> str:
    """The directory of a model on a cache claim: a readable name and a hash of what the
    fill reads. The image is in it because every source is read from the image (the
    bundled model, its paths, its HF cache): a new image is filled anew, never served
    from an older image's files. Services with the same source and image share one."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}\n{source}\n{image}".encode()).hexdigest()[:16]
    name = names.DEFAULT_SERVED_MODEL_NAME if source == "bundled" else _default_name(source)
    readable = re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-.")[:40] or "model"
    return f"{readable}-{digest}"


def cache_path(spec: InferenceServiceSpec, image: str) -> str | None:
    """Where the model cache holds this service's model in the containers; None without
    a cache."""
    cache = spec.model.cache
    if cache is None:
        return None
    return f"{MODEL_MOUNT_ROOT}/{cache.claim_name}/{cache_key(spec.model.source, image)}"


def plan_model(spec: InferenceServiceSpec, image: str) -> ModelPlan:
    """The server's model: from the cache when there is one (``image`` keys it)."""
    source = spec.model.source
    served = spec.model.name
    if source == "bundled":
        served = served or names.DEFAULT_SERVED_MODEL_NAME
        path = "bundled"
    else:
        path = resolve_source(source)[0]
        served = served or _default_name(path)
    return ModelPlan(cache_path(spec, image) or path, served, pvc=model_claim(spec))


def plan_adapters(spec: InferenceServiceSpec) -> list[AdapterPlan]:
    return [AdapterPlan(a.name, *resolve_source(a.source)) for a in spec.adapters]


def plan_adapter_resolver(spec: InferenceServiceSpec) -> tuple[str, str | None] | None:
    """(the server's --lora-resolver-dir, the claim to mount) of spec.adapterResolver, or
    None without one."""
    resolver = spec.adapter_resolver
    return resolve_source(resolver.source) if resolver is not None else None


def lora_enabled(spec: InferenceServiceSpec) -> bool:
    return spec.engine.enable_lora or bool(spec.adapters) or spec.adapter_resolver is not None


def adapter_claims(spec: InferenceServiceSpec) -> list[str]:
    """Claims the adapters (spec.adapters and spec.adapterResolver) need beyond the
    model's, each once, sorted: each is mounted, and one that is missing marks the service
    Degraded."""
    model = model_claim(spec)
    claims = {p.pvc for p in plan_adapters(spec)}
    if (resolver := plan_adapter_resolver(spec)) is not None:
        claims.add(resolver[1])
    return sorted(c for c in claims if c and c != model)


def _default_name(source: str) -> str:
    last = source.rstrip("/").rsplit("/", 1)[-1]
    return last.removesuffix(".gguf") or "model"


def desired_replicas(spec: InferenceServiceSpec, loops: LoopState) -> int:
    """The built-in autoscaler's decision within bounds; otherwise spec.replicas, which the
    user, their HPA or the emitted HPA/ScaledObject set through the scale subresource.
    Before the loop's first decision, spec.replicas within bounds: turning builtin
    autoscaling on must not cut a running service down to minReplicas while the loop has
    not looked yet."""
    a = spec.autoscaling
    if not a.builtin:
        return spec.replicas
    decided = loops.replicas if loops.replicas is not None else spec.replicas
    return _clamp(decided, a.min_replicas, a.max_replicas)


def effective_engine(spec: InferenceServiceSpec, loops: LoopState) -> EngineSpec:
    """spec.engine with the tuner's decisions applied, within spec.tuning's bounds; LoRA on
    whenever the spec has adapters."""
    t = spec.tuning
    update: dict = {"enable_lora": True} if lora_enabled(spec) else {}
    if not t.enabled:
        return spec.engine.model_copy(update=update) if update else spec.engine
    if loops.max_num_seqs is not None:
        update["max_num_seqs"] = _clamp(loops.max_num_seqs, t.max_num_seqs.min, t.max_num_seqs.max)
    if loops.kv_cache_dtype is not None and (
        loops.kv_cache_dtype == spec.engine.kv_cache_dtype
        or (t.allow_fp8_kv_cache and loops.kv_cache_dtype.startswith("fp8"))
    ):
        update["kv_cache_dtype"] = loops.kv_cache_dtype
    if (budget := tuned_step_budget(spec)) is not None:
        # Nothing decided and nothing asked: the budget the pods start with stays.
        value = loops.max_num_batched_tokens or spec.engine.max_num_batched_tokens or budget.max
        update["max_num_batched_tokens"] = _clamp(value, budget.min, budget.max)
    if loops.max_loras is not None and t.max_loras is not None:
        update["max_loras"] = _clamp(loops.max_loras, t.max_loras.min, t.max_loras.max)
    return spec.engine.model_copy(update=update) if update else spec.engine


def tuned_step_budget(spec: InferenceServiceSpec) -> TokenRange | None:
    """The range the tuner keeps max_num_batched_tokens within; None when it leaves it be."""
    return spec.tuning.max_num_batched_tokens if spec.tuning.enabled else None


def start_engine(spec: InferenceServiceSpec, engine: EngineSpec) -> EngineSpec:
    """The engine a pod template starts: with the step budget tuned, at the range's max.
    The engine profiles its memory for the budget it starts with and refuses a live one
    past it, so starting at the max lets every tuned value in; and the template never
    carries the tuned value, so a tuned change rolls nothing (the loop sets it live on
    each replica once it is up)."""
    budget = tuned_step_budget(spec)
    if budget is None:
        return engine
    return engine.model_copy(update={"max_num_batched_tokens": budget.max})
