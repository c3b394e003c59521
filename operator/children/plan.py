"""What the spec asks to run, before any manifest: the model and adapters (paths, claims),
the replicas, and the engine with the loops' decisions applied within the spec's bounds."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from batchpilot import names
from batchpilot.operator.crd.engine import EngineSpec
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.crd.tuning import TokenRange
from batchpilot.operator.loop.state import LoopState

MODEL_MOUNT_ROOT = "/models"


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


def plan_model(spec: InferenceServiceSpec) -> ModelPlan:
    source = spec.model.source
    if source == "bundled":
        return ModelPlan("bundled", spec.model.name or names.DEFAULT_SERVED_MODEL_NAME)
    path, claim = resolve_source(source)
    return ModelPlan(path, spec.model.name or _default_name(path), pvc=claim)


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
    model = plan_model(spec).pvc
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
