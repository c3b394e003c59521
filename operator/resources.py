"""Pure builders: an InferenceService's spec in, the children's manifests out.

No I/O here. The kopf handlers (handlers.py) parse the object, call these, and apply the
results with server-side apply under one field manager. Every output is deterministic: the
same inputs give byte-identical manifests, so a re-apply never rolls the Deployment.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import posixpath
import re
from dataclasses import dataclass
from fractions import Fraction

from batchpilot import names
from batchpilot.operator.crd import API_VERSION, KIND, EngineSpec, InferenceServiceSpec, TokenRange
from batchpilot.operator.flags import BOOL_KNOBS, ENABLE_LORA, ENGINE_KNOBS, LORA_KNOBS
from batchpilot.operator.loop.state import LoopState

PORT = names.DEFAULT_PORT
PORT_NAME = "http"
# /admin/* listens here only; the Service does not expose it, the operator calls each pod.
ADMIN_PORT = names.DEFAULT_ADMIN_PORT
ADMIN_PORT_NAME = "admin"
CONTAINER = "server"
MODEL_VOLUME = "model"
MODEL_MOUNT_ROOT = "/models"
# Volumes of adapter claims other than the model's: named after a hash of the claim, so
# that reordering or adding adapters leaves the other volumes' names, and the pods, alone.
ADAPTER_VOLUME_PREFIX = "adapters-"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = "batchpilot.dev/service"
APP_NAME = "batchpilot-server"
MANAGED_BY = "batchpilot-operator"
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"

# The engine settings the operator applied (JSON, on the Deployment's own metadata: a
# change of it alone never rolls the pods).
ANN_ENGINE = "batchpilot.dev/engine"
SECRET_TOKEN_KEY = "token"
# A ServiceAccount InferenceServices may run their pods as carries this label (value
# "allowed"): the allow-list is kept by whoever may label ServiceAccounts.
LABEL_SA_ALLOWED = "batchpilot.dev/inference-server"

# The server image's non-root user (server/Dockerfile), forced on every pod.
RUN_AS_USER = 10001
# The root filesystem is read-only; the server writes only under these emptyDirs: /tmp
# (tempfile, the image's HF_HOME) and a home whose cache holds the CPU decode kernel's
# build (torch.utils.cpp_extension), Triton's kernel cache, and a model conversion cache
# where the image has none (the server image's own, $BATCHPILOT_CACHE, is read-only).
HOME = "/home/batchpilot"
SCRATCH_VOLUMES = (("batchpilot-tmp", "/tmp"), ("batchpilot-home", HOME))
SCRATCH_ENV = (
    ("HOME", HOME),
    ("TORCH_EXTENSIONS_DIR", f"{HOME}/.cache/torch_extensions"),
    ("TRITON_CACHE_DIR", f"{HOME}/.cache/triton"),
)

# Seconds between SIGTERM's drain deadline and the kubelet's SIGKILL.
GRACE_MARGIN_SECONDS = 15

# While the tuner is on, max_num_seqs reaches new pods through this variable, read from the
# service's ConfigMap: a tuned value changes the ConfigMap, never the pod template, so it
# rolls nothing (running pods get it live through /admin/config).
MAX_NUM_SEQS_ENV = "BATCHPILOT_MAX_NUM_SEQS"
RESERVED_ENV = frozenset([names.ADMIN_TOKEN_ENV, MAX_NUM_SEQS_ENV, names.LORA_MODULES_ENV])
# spec.adapters reach new pods through this ConfigMap key (--preload-lora-modules' variable):
# a new replica starts serving them, and a change of the list rolls nothing (running pods
# get it through their admin API).
LORA_MODULES_KEY = "lora-modules"
# A CPU pod's thread budget (server/cpu_budget.py): from its CPU limit, else its request.
# The server reads a limit itself (the CFS quota), but not a request, which leaves it no
# quota: without this variable a pod requesting 2 CPUs on a 64-CPU node ran 64 threads. Not
# set where the user's pod.env sets it or OMP_NUM_THREADS: theirs wins.
CPU_THREADS_OVERRIDES = frozenset([names.CPU_THREADS_ENV, "OMP_NUM_THREADS"])

HPA_METRIC = names.NUM_REQUESTS_WAITING
KEDA_API_VERSION = "keda.sh/v1alpha1"
# Children that exist only in some autoscaling modes: (apiVersion, kind), named like the
# service. The reconcile deletes those the spec no longer asks for.
HPA_KIND = ("autoscaling/v2", "HorizontalPodAutoscaler")
SCALED_OBJECT_KIND = (KEDA_API_VERSION, "ScaledObject")
INFERENCE_POOL_KIND = ("inference.networking.k8s.io/v1", "InferencePool")
ENDPOINT_SLICE_KIND = ("discovery.k8s.io/v1", "EndpointSlice")
# The EndpointSlice controller manages the slices of Services with a selector; a Service
# without one (routed to the activator) gets ours, marked so that controller leaves it.
SLICE_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
SLICE_SERVICE_NAME = "kubernetes.io/service-name"
SLICE_CONTROLLER = "endpointslice-controller.k8s.io"
# Added to the Service's selector while it routes to the activator: no pod has it, so the
# EndpointSlice controller keeps syncing the Service (its slices go empty as the last pod
# goes) while the operator's own slice holds the activator. Dropping the selector instead
# races the controller: it stops syncing, and a slice it had just remade kept a gone pod,
# which timed out 4 of 8 requests at zero in kind.
LABEL_ROUTED = "batchpilot.dev/routed-to"


@dataclass(frozen=True)
class Owner:
    """The InferenceService the children belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


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


def lora_enabled(spec: InferenceServiceSpec) -> bool:
    return spec.engine.enable_lora or bool(spec.adapters)


def adapter_claims(spec: InferenceServiceSpec) -> list[str]:
    """Claims the adapters need beyond the model's, each once, sorted."""
    model = plan_model(spec).pvc
    return sorted({p.pvc for p in plan_adapters(spec) if p.pvc and p.pvc != model})


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


def spec_problems(spec: InferenceServiceSpec) -> list[str]:
    """What the schema cannot express but the operator rejects before building anything
    (engine.extraArgs are checked by the schema's own rule)."""
    problems = []
    for env in spec.pod.env:
        if env.name in RESERVED_ENV:
            problems.append(f"spec.pod.env: {env.name} is set by the operator")
    return problems


def _field(knob: names.Knob) -> str:
    """EngineSpec's attribute for a knob (the spec states swap space in GiB)."""
    return "swap_space_gib" if knob is names.SWAP_SPACE else knob.name


def _num(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def engine_knobs(engine: EngineSpec) -> tuple[names.Knob, ...]:
    """The knobs a pod template sets: LoRA's only with LoRA on, so that a service without
    adapters keeps its template (and its pods) across an operator upgrade."""
    return (*ENGINE_KNOBS, *LORA_KNOBS) if engine.enable_lora else ENGINE_KNOBS


def engine_args(engine: EngineSpec, *, live_max_num_seqs: bool = False) -> list[str]:
    """The engine flags; with ``live_max_num_seqs`` (the tuner on) --max-num-seqs reads the
    ConfigMap-backed variable, which Kubernetes expands in args. The adapters themselves are
    never flags (no --lora-modules): new pods read them from the ConfigMap and running ones
    get them through their admin API, so adding or removing one never changes the
    template."""
    args = ["--dtype", engine.dtype] + ([ENABLE_LORA] if engine.enable_lora else [])
    for knob in engine_knobs(engine):
        value = getattr(engine, _field(knob))
        if value is None:
            continue
        if knob is names.MAX_NUM_SEQS and live_max_num_seqs:
            args.append(f"{knob.flag}=$({MAX_NUM_SEQS_ENV})")
        elif knob.name in BOOL_KNOBS:
            args.append(knob.flag if value else "--no-" + knob.flag[2:])
        else:
            args += [knob.flag, value if isinstance(value, str) else _num(value)]
    return args


def server_args(spec: InferenceServiceSpec, engine: EngineSpec, model: ModelPlan) -> list[str]:
    s = spec.server
    return [
        "--host",
        "0.0.0.0",
        "--port",
        str(PORT),
        "--admin-port",
        str(ADMIN_PORT),
        "--model",
        model.arg,
        "--served-model-name",
        model.served_name,
        *engine_args(engine, live_max_num_seqs=spec.tuning.enabled),
        "--max-queue-len",
        str(s.max_queue_len),
        "--shutdown-timeout",
        str(s.shutdown_timeout_seconds),
        *engine.extra_args,
    ]


def engine_settings(engine: EngineSpec) -> dict:
    """The engine settings a pod template puts in force, camelCase like status.engine: what
    the Deployment records in its ANN_ENGINE annotation and status reads back."""
    out = {}
    for knob in engine_knobs(engine):
        value = getattr(engine, _field(knob))
        if value is not None:
            out[knob.crd_field] = value
    return out


def read_engine_settings(deployment: dict) -> dict:
    """The settings a live Deployment records (empty when it records none or garbage: the
    next apply writes the annotation back)."""
    raw = (deployment.get("metadata", {}).get("annotations") or {}).get(ANN_ENGINE, "")
    try:
        settings = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return settings if isinstance(settings, dict) else {}


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_NAME: APP_NAME, LABEL_SERVICE: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def common_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: "server",
        LABEL_PART_OF: "batchpilot",
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def owner_reference(owner: Owner) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner, name: str, annotations: dict | None = None) -> dict:
    meta = {
        "name": name,
        "namespace": owner.namespace,
        "labels": common_labels(owner.name),
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def admin_token(key: bytes, owner: Owner) -> str:
    """The service's admin token: an HMAC of the operator's key and the object's identity.
    The operator recomputes it whenever it needs it and never reads it back, so it needs
    no right to read Secrets; a new object with the same name (a new uid) gets another."""
    identity = f"admin-token\0{owner.namespace}\0{owner.name}\0{owner.uid}".encode()
    digest = hmac.new(key, identity, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def secret_name(name: str, token: str) -> str:
    """The Secret holding ``token``, named after a hash of it: no one without the operator's
    key can tell the name before the operator creates it, so no one can have put another
    Secret there; a new token (a new key) is a new Secret, and the pods roll to it."""
    return f"{name}-admin-{hashlib.sha256(token.encode()).hexdigest()[:12]}"


def config_map_name(name: str) -> str:
    return f"{name}-engine"


def service_url(name: str, namespace: str, cluster_domain: str) -> str:
    return f"http://{name}.{namespace}.svc.{cluster_domain}:{PORT}"


def scrape_annotations() -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
    }


def build_secret(owner: Owner, token: str) -> dict:
    """The admin API's bearer token, for the pods' environment; created once, never
    changed (its name changes with the token)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(owner, secret_name(owner.name, token)),
        "type": "Opaque",
        "immutable": True,
        "data": {SECRET_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_config_map(owner: Owner, spec: InferenceServiceSpec, engine: EngineSpec) -> dict:
    """What new pods read without a rollout: the tuner's max_num_seqs and the adapters to
    start with; a tuned max_num_batched_tokens is only recorded, for humans (pods start at
    the range's max and the loop sets it live)."""
    data = {names.MAX_NUM_SEQS.name: str(engine.max_num_seqs)}
    if tuned_step_budget(spec) is not None:
        data[names.MAX_NUM_BATCHED_TOKENS.name] = str(engine.max_num_batched_tokens)
    if lora_enabled(spec):
        modules = [{"name": a.name, "path": a.path} for a in plan_adapters(spec)]
        data[LORA_MODULES_KEY] = json.dumps(modules, separators=(",", ":"))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, config_map_name(owner.name)),
        "data": data,
    }


@dataclass(frozen=True)
class Activator:
    """Where the activator listens: its Ready pods' addresses and their port."""

    addresses: tuple[str, ...]
    port: int


def activator_of(slices: list[dict]) -> Activator | None:
    """The activator from its Service's EndpointSlices (Ready endpoints, the port named
    http); None when no slice names that port yet."""
    port = next(
        (p["port"] for s in slices for p in s.get("ports") or [] if p.get("name") == PORT_NAME),
        None,
    )
    if port is None:
        return None
    addresses = sorted(
        {
            a
            for s in slices
            for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready", True)
            for a in e.get("addresses") or []
        }
    )
    return Activator(tuple(addresses), port)


def may_route_to_activator(spec: InferenceServiceSpec) -> bool:
    """A service the built-in autoscaler may take to zero."""
    return spec.autoscaling.builtin and spec.autoscaling.min_replicas == 0


def routes_to_activator(
    spec: InferenceServiceSpec, desired: int, ready: int, activator: Activator | None
) -> bool:
    """Does the Service send its traffic to the activator? Only for a service that may go
    to zero, while none of its replicas is Ready: at zero, and while the first one starts."""
    return activator is not None and may_route_to_activator(spec) and (desired == 0 or ready == 0)


def service_selector(name: str, *, to_activator: bool = False) -> dict[str, str]:
    """The server pods; while the Service routes to the activator, none (LABEL_ROUTED)."""
    routed = {LABEL_ROUTED: "activator"} if to_activator else {}
    return {**selector_labels(name), **routed}


def build_service(owner: Owner, *, to_activator: bool = False) -> dict:
    """While it routes to the activator, its selector matches no pod, and its endpoints
    are the activator's, in the EndpointSlice the operator writes (build_activator_slice)."""
    selector = {"selector": service_selector(owner.name, to_activator=to_activator)}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, owner.name, scrape_annotations()),
        "spec": {
            "type": "ClusterIP",
            **selector,
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": PORT,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def controller_slices_selector(name: str) -> str:
    """The EndpointSlice controller's slices of the Service ``name``."""
    return f"{SLICE_SERVICE_NAME}={name},{SLICE_MANAGED_BY}={SLICE_CONTROLLER}"


def build_activator_slice(owner: Owner, activator: Activator) -> dict:
    """The Service's endpoints while it routes to the activator: the activator's pods, on
    the activator's port, under the Service's port name."""
    meta = _metadata(owner, owner.name)
    meta["labels"] = {
        **meta["labels"],
        SLICE_SERVICE_NAME: owner.name,
        SLICE_MANAGED_BY: MANAGED_BY,
    }
    return {
        "apiVersion": ENDPOINT_SLICE_KIND[0],
        "kind": ENDPOINT_SLICE_KIND[1],
        "metadata": meta,
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [a], "conditions": {"ready": True}} for a in activator.addresses
        ],
        "ports": [{"name": PORT_NAME, "port": activator.port, "protocol": "TCP"}],
    }


def build_pdb(owner: Owner) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, owner.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
            # A pod that never became ready may be evicted: it serves nothing.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _probe(path: str, period: int, failures: int, timeout: int) -> dict:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    s = spec.server
    return s.pre_stop_sleep_seconds + s.shutdown_timeout_seconds + GRACE_MARGIN_SECONDS


def server_env(owner: Owner, spec: InferenceServiceSpec, token: str) -> list[dict]:
    """The admin token from the owned Secret, the writable places, max_num_seqs from the
    ConfigMap (tuner on), what the model source needs, a CPU pod's threads, then the
    user's."""
    ref = {"name": secret_name(owner.name, token), "key": SECRET_TOKEN_KEY}
    env = [{"name": names.ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}}]
    env += [{"name": k, "value": v} for k, v in SCRATCH_ENV]
    if spec.tuning.enabled:
        ref = {"name": config_map_name(owner.name), "key": names.MAX_NUM_SEQS.name}
        env.append({"name": MAX_NUM_SEQS_ENV, "valueFrom": {"configMapKeyRef": ref}})
    # With LoRA on, whatever the adapters' sources: adding an hf:// adapter must not change
    # the template (and nothing in the server downloads anyway).
    if spec.model.source.startswith("hf://") or lora_enabled(spec):
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})  # pre-cached: never download
    if lora_enabled(spec):
        # optional: a pod made before the operator wrote the key starts without adapters
        # (its sync loads them) rather than failing to start.
        ref = {"name": config_map_name(owner.name), "key": LORA_MODULES_KEY, "optional": True}
        env.append({"name": names.LORA_MODULES_ENV, "valueFrom": {"configMapKeyRef": ref}})
    if (threads := cpu_threads(spec)) is not None:
        env.append({"name": names.CPU_THREADS_ENV, "value": str(threads)})
    return env + [e.to_api() for e in spec.pod.env]


_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?"
)
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(value: int | str) -> Fraction | None:
    """A Kubernetes quantity ("2", "1500m", "0.5", "1e3", "2Gi") as an exact number; None
    where it cannot be read."""
    m = _QUANTITY.fullmatch(str(value).strip())
    if m is None:
        return None
    number, suffix = Fraction(m[1]), m[2] or ""
    if suffix.endswith("i"):
        return number * 1024 ** ("KMGTPE".index(suffix[0]) + 1)
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return number * Fraction(10) ** int(suffix[1:])
    return number * Fraction(10) ** _DECIMAL[suffix]


def gpu_pod(spec: InferenceServiceSpec) -> bool:
    """Asks for a GPU: some `<vendor>/gpu` resource (nvidia.com/gpu, amd.com/gpu) above 0."""
    resources = {**spec.resources.requests, **spec.resources.limits}
    return any(name.endswith("/gpu") and (parse_quantity(q) or 0) > 0
               for name, q in resources.items())  # fmt: skip


def cpu_threads(spec: InferenceServiceSpec) -> int | None:
    """A CPU pod's threads: its CPU limit, else its request, rounded up (at least 1). None
    for GPU pods, without a CPU amount, or where pod.env sets the threads itself."""
    if gpu_pod(spec) or any(e.name in CPU_THREADS_OVERRIDES for e in spec.pod.env):
        return None
    cpu = spec.resources.limits.get("cpu", spec.resources.requests.get("cpu"))
    cpus = parse_quantity(cpu) if cpu is not None else None
    return max(1, math.ceil(cpus)) if cpus is not None and cpus > 0 else None


def adapter_volume_name(claim: str) -> str:
    return ADAPTER_VOLUME_PREFIX + hashlib.sha256(claim.encode()).hexdigest()[:12]


def _claim_volume(volume: str, claim: str) -> tuple[dict, dict]:
    """A claim, read-only, and its mount at MODEL_MOUNT_ROOT/<claim>."""
    source = {"claimName": claim, "readOnly": True}
    mount = {"name": volume, "mountPath": f"{MODEL_MOUNT_ROOT}/{claim}", "readOnly": True}
    return {"name": volume, "persistentVolumeClaim": source}, mount


def model_volumes(spec: InferenceServiceSpec, model: ModelPlan) -> tuple[list, list]:
    """(volumes, the server's mounts): the scratch emptyDirs, a pvc:// model's claim, the
    adapters' other claims (each once, read-only), then the user's."""
    volumes = [{"name": n, "emptyDir": {}} for n, _ in SCRATCH_VOLUMES]
    mounts = [{"name": n, "mountPath": path} for n, path in SCRATCH_VOLUMES]
    claims = [(MODEL_VOLUME, model.pvc)] if model.pvc else []
    claims += [(adapter_volume_name(c), c) for c in adapter_claims(spec)]
    for volume, claim in claims:
        v, m = _claim_volume(volume, claim)
        volumes.append(v)
        mounts.append(m)
    return volumes + list(spec.pod.volumes), mounts + list(spec.pod.volume_mounts)


def pod_security_context() -> dict:
    """The restricted Pod Security Standard, at the pod level."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict:
    """The restricted Pod Security Standard, for the server container, plus a read-only
    root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def service_account_allowed(service_account: dict) -> bool:
    labels = service_account.get("metadata", {}).get("labels") or {}
    return labels.get(LABEL_SA_ALLOWED) == "allowed"


def container_resources(spec: InferenceServiceSpec) -> dict:
    return {k: {n: str(q) for n, q in v.items()} for k, v in spec.resources.to_api().items() if v}


def build_container(
    owner: Owner,
    spec: InferenceServiceSpec,
    engine: EngineSpec,
    image: str,
    mounts: list,
    token: str,
) -> dict:
    container: dict = {
        "name": CONTAINER,
        "image": image,
        "command": ["batchpilot", "serve"],
        "args": server_args(spec, engine, plan_model(spec)),
        "ports": [
            {"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"},
            {"name": ADMIN_PORT_NAME, "containerPort": ADMIN_PORT, "protocol": "TCP"},
        ],
        "env": server_env(owner, spec, token),
        # Probed every 2 s: a replica woken from zero serves what the activator holds as soon
        # as it is Ready (at 5 s the kubelet took 2.7 s on average to see it). 8 failures:
        # the same 16 s a busy CPU server may go without answering before it drops out.
        "readinessProbe": _probe("/ready", period=2, failures=8, timeout=2),
        "livenessProbe": _probe("/health", period=10, failures=6, timeout=5),
        # Loading weights can take minutes: liveness starts once /health first answers.
        "startupProbe": _probe("/health", period=5, failures=180, timeout=5),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if resources := container_resources(spec):
        container["resources"] = resources
    if sleep := spec.server.pre_stop_sleep_seconds:
        # Endpoints drop the pod while it still serves; then SIGTERM starts the drain.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": sleep}}}
    container["volumeMounts"] = mounts
    container["securityContext"] = container_security_context()
    return container


def build_pod_spec(spec: InferenceServiceSpec, container: dict, volumes: list) -> dict:
    pod = spec.pod
    pod_spec: dict = {
        "containers": [container],
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
    }
    if pod.service_account_name:
        pod_spec["serviceAccountName"] = pod.service_account_name
    else:
        pod_spec["automountServiceAccountToken"] = False  # the server never calls the API
    for key, value in (
        ("nodeSelector", dict(pod.node_selector)),
        ("tolerations", [t.to_api() for t in pod.tolerations]),
        ("affinity", pod.affinity),
        ("imagePullSecrets", [r.to_api() for r in pod.image_pull_secrets]),
        ("priorityClassName", pod.priority_class_name),
        ("volumes", volumes),
    ):
        if value:
            pod_spec[key] = value
    return pod_spec


def build_pod_template(
    owner: Owner, spec: InferenceServiceSpec, engine: EngineSpec, image: str, admin_token: str
) -> dict:
    volumes, mounts = model_volumes(spec, plan_model(spec))
    # A new token rolls the pods (they read it at start): it is in a Secret of a new name.
    container = build_container(owner, spec, engine, image, mounts, admin_token)
    annotations = {**spec.pod.annotations, **scrape_annotations()}
    return {
        "metadata": {
            "labels": {**spec.pod.labels, **common_labels(owner.name)},
            "annotations": annotations,
        },
        "spec": build_pod_spec(spec, container, volumes),
    }


def build_deployment(
    owner: Owner,
    spec: InferenceServiceSpec,
    *,
    image: str,
    admin_token: str,
    loops: LoopState = LoopState(),
) -> dict:
    engine = start_engine(spec, effective_engine(spec, loops))
    applied = json.dumps(engine_settings(engine), sort_keys=True, separators=(",", ":"))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, owner.name, {ANN_ENGINE: applied}),
        "spec": {
            "replicas": desired_replicas(spec, loops),
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": 1200,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": build_pod_template(owner, spec, engine, image, admin_token),
        },
    }


def quantity(value: float) -> str:
    """A decimal value as the API server writes it back (4 -> "4", 0.5 -> "500m",
    2000 -> "2k"): applying the canonical form keeps a re-read from looking like drift."""
    scaled, suffixes = max(1, round(value * 1000)), ["m", "", "k", "M", "G", "T", "P", "E"]
    i = 0
    while scaled % 1000 == 0 and i < len(suffixes) - 1:
        scaled, i = scaled // 1000, i + 1
    return f"{scaled}{suffixes[i]}"


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
        "metadata": _metadata(owner, owner.name),
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
        "metadata": _metadata(owner, owner.name),
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


def build_inference_pool(owner: Owner, spec: InferenceServiceSpec) -> dict:
    """A Gateway API Inference Extension InferencePool over the server pods: the gateway
    asks the endpoint picker which pod of the pool takes each request, and the picker reads
    each pod's vLLM queue and KV-cache metrics on the serving port."""
    epp = spec.routing.endpoint_picker
    assert epp is not None  # RoutingSpec's rule
    return {
        "apiVersion": INFERENCE_POOL_KIND[0],
        "kind": INFERENCE_POOL_KIND[1],
        "metadata": _metadata(owner, owner.name),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "targetPorts": [{"number": PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp.name,
                "port": {"number": epp.port},
                "failureMode": epp.failure_mode,
            },
        },
    }


def optional_kinds(spec: InferenceServiceSpec) -> list[tuple[str, str]]:
    """(apiVersion, kind) of the children beyond the core ones that the spec asks for: CRDs
    the cluster may not serve."""
    kinds = [autoscaler_kind(spec)]
    if spec.routing.inference_pool:
        kinds.append(INFERENCE_POOL_KIND)
    return [k for k in kinds if k is not None]


def optional_children(owner: Owner, spec: InferenceServiceSpec) -> list[dict]:
    pool = [build_inference_pool(owner, spec)] if spec.routing.inference_pool else []
    return [*autoscaler_children(owner, spec), *pool]


def stale_kinds(spec: InferenceServiceSpec, *, to_activator: bool = False) -> list[tuple[str, str]]:
    """(apiVersion, kind) of optional children not asked for now: any left from an earlier
    spec (or, for the activator's EndpointSlice, from the time at zero) are deleted."""
    wanted = [*optional_kinds(spec), *([ENDPOINT_SLICE_KIND] if to_activator else [])]
    optional = (HPA_KIND, SCALED_OBJECT_KIND, INFERENCE_POOL_KIND, ENDPOINT_SLICE_KIND)
    return [k for k in optional if k not in wanted]


def build_children(
    owner: Owner,
    spec: InferenceServiceSpec,
    *,
    image: str,
    admin_token: str,
    loops: LoopState = LoopState(),
    activator: Activator | None = None,
) -> list[dict]:
    """Every child, in apply order: what the Deployment reads (Secret, ConfigMap) before it,
    what scales or routes to it after it. ``activator``: given only while the Service
    routes there (routes_to_activator)."""
    engine = effective_engine(spec, loops)
    slice_ = [build_activator_slice(owner, activator)] if activator else []
    return [
        build_secret(owner, admin_token),
        build_config_map(owner, spec, engine),
        *slice_,
        build_service(owner, to_activator=activator is not None),
        build_pdb(owner),
        build_deployment(owner, spec, image=image, admin_token=admin_token, loops=loops),
        *optional_children(owner, spec),
    ]
