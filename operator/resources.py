"""Pure builders: an InferenceService's spec in, the children's manifests out.

No I/O here. The kopf handlers (handlers.py) parse the object, call these, and apply the
results with server-side apply under one field manager. Every output is deterministic: the
same inputs give byte-identical manifests, so a re-apply never rolls the Deployment.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
from dataclasses import dataclass

from batchpilot import names
from batchpilot.operator.crd import API_VERSION, KIND, EngineSpec, InferenceServiceSpec

PORT = names.DEFAULT_PORT
PORT_NAME = "http"
CONTAINER = "server"
MODEL_VOLUME = "model"
MODEL_MOUNT_ROOT = "/models"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = "batchpilot.dev/service"
APP_NAME = "batchpilot-server"
MANAGED_BY = "batchpilot-operator"
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"

ANN_TOKEN_HASH = "batchpilot.dev/admin-token-sha256"
SECRET_TOKEN_KEY = "token"

# Seconds between SIGTERM's drain deadline and the kubelet's SIGKILL.
GRACE_MARGIN_SECONDS = 15

# Flags the operator derives from the spec: engine.extraArgs may not repeat them.
ENGINE_KNOBS = (
    names.MAX_MODEL_LEN,
    names.MAX_NUM_SEQS,
    names.MAX_NUM_BATCHED_TOKENS,
    names.BLOCK_SIZE,
    names.KV_CACHE_DTYPE,
    names.GPU_MEMORY_UTILIZATION,
    names.SWAP_SPACE,
    names.PREEMPTION_MODE,
    names.ENABLE_CHUNKED_PREFILL,
    names.ENABLE_PREFIX_CACHING,
)
_BOOL_KNOBS = {names.ENABLE_CHUNKED_PREFILL.name, names.ENABLE_PREFIX_CACHING.name}
MANAGED_FLAGS = frozenset(
    [
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--dtype",
        "--shutdown-timeout",
        "--max-queue-len",
        "--admin-token",
    ]
    + [k.flag for k in ENGINE_KNOBS]
    + ["--no-" + k.flag[2:] for k in ENGINE_KNOBS if k.name in _BOOL_KNOBS]
)
RESERVED_ENV = frozenset([names.ADMIN_TOKEN_ENV])


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
class LoopState:
    """What the autoscaler and the tuner have decided, read back from status (None: nothing
    yet). The builders persist it in the Deployment so that new pods start with it."""

    replicas: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str | None = None

    @classmethod
    def from_status(cls, status: dict | None) -> LoopState:
        status = status or {}
        autoscaling = status.get("autoscaling") or {}
        tuning = status.get("tuning") or {}
        return cls(
            replicas=autoscaling.get("desiredReplicas"),
            max_num_seqs=tuning.get(names.MAX_NUM_SEQS.crd_field),
            kv_cache_dtype=tuning.get(names.KV_CACHE_DTYPE.crd_field),
        )


@dataclass(frozen=True)
class ModelPlan:
    arg: str  # the server's --model
    served_name: str
    pvc: str | None = None  # claim to mount read-only at MODEL_MOUNT_ROOT/<claim>


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def plan_model(spec: InferenceServiceSpec) -> ModelPlan:
    source = spec.model.source
    if source == "bundled":
        return ModelPlan("bundled", spec.model.name or names.DEFAULT_SERVED_MODEL_NAME)
    if source.startswith("pvc://"):
        claim, _, sub = source.removeprefix("pvc://").partition("/")
        root = f"{MODEL_MOUNT_ROOT}/{claim}"
        path = posixpath.normpath(posixpath.join(root, sub))
        if path != root and not path.startswith(root + "/"):  # "pvc://c/../../etc"
            path = root
        return ModelPlan(path, spec.model.name or _default_name(path), pvc=claim)
    return ModelPlan(source, spec.model.name or _default_name(source))


def _default_name(source: str) -> str:
    last = source.rstrip("/").rsplit("/", 1)[-1]
    return last.removesuffix(".gguf") or "model"


def desired_replicas(spec: InferenceServiceSpec, loops: LoopState) -> int:
    a = spec.autoscaling
    if not a.enabled:
        return spec.replicas
    return _clamp(
        loops.replicas if loops.replicas is not None else a.min_replicas,
        a.min_replicas,
        a.max_replicas,
    )


def effective_engine(spec: InferenceServiceSpec, loops: LoopState) -> EngineSpec:
    """spec.engine with the tuner's decisions applied, within spec.tuning's bounds."""
    t = spec.tuning
    if not t.enabled:
        return spec.engine
    update: dict = {}
    if loops.max_num_seqs is not None:
        update["max_num_seqs"] = _clamp(loops.max_num_seqs, t.max_num_seqs.min, t.max_num_seqs.max)
    if loops.kv_cache_dtype is not None and (
        loops.kv_cache_dtype == spec.engine.kv_cache_dtype
        or (t.allow_fp8_kv_cache and loops.kv_cache_dtype.startswith("fp8"))
    ):
        update["kv_cache_dtype"] = loops.kv_cache_dtype
    return spec.engine.model_copy(update=update) if update else spec.engine


def spec_problems(spec: InferenceServiceSpec) -> list[str]:
    """What the schema cannot express but the operator rejects before building anything."""
    problems = []
    for arg in spec.engine.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            problems.append(
                f"spec.engine.extraArgs: {flag} is derived from the spec; set it there instead"
            )
    for env in spec.pod.env:
        if env.name in RESERVED_ENV:
            problems.append(f"spec.pod.env: {env.name} is set by the operator")
    return problems


def _num(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def engine_args(engine: EngineSpec) -> list[str]:
    args = ["--dtype", engine.dtype]
    for knob in ENGINE_KNOBS:
        value = getattr(engine, "swap_space_gib" if knob is names.SWAP_SPACE else knob.name)
        if value is None:
            continue
        if knob.name in _BOOL_KNOBS:
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
        "--model",
        model.arg,
        "--served-model-name",
        model.served_name,
        *engine_args(engine),
        "--max-queue-len",
        str(s.max_queue_len),
        "--shutdown-timeout",
        str(s.shutdown_timeout_seconds),
        *engine.extra_args,
    ]


def parse_engine_args(args: list[str]) -> dict:
    """The engine settings a container's args put in force (camelCase, like status.engine):
    the inverse of engine_args, read back from a live Deployment."""
    by_flag = {k.flag: k for k in ENGINE_KNOBS}
    out: dict = {}
    it = iter(args)
    for arg in it:
        flag, eq, inline = arg.partition("=")
        knob = by_flag.get(flag)
        if knob is None or knob.name in _BOOL_KNOBS:
            continue
        raw = inline if eq else next(it, None)
        if raw is None:
            break
        try:
            out[knob.crd_field] = int(raw)
        except ValueError:
            try:
                out[knob.crd_field] = float(raw)
            except ValueError:
                out[knob.crd_field] = raw
    return out


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


def secret_name(name: str) -> str:
    return f"{name}-admin-token"


def service_url(name: str, namespace: str, cluster_domain: str) -> str:
    return f"http://{name}.{namespace}.svc.{cluster_domain}:{PORT}"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def scrape_annotations() -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
    }


def build_secret(owner: Owner, token: str) -> dict:
    """The admin API's bearer token; the operator generates it once and owns it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(owner, secret_name(owner.name)),
        "type": "Opaque",
        "data": {SECRET_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_service(owner: Owner) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, owner.name, scrape_annotations()),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
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


def build_deployment(
    owner: Owner,
    spec: InferenceServiceSpec,
    *,
    image: str,
    admin_token: str,
    loops: LoopState = LoopState(),
) -> dict:
    engine = effective_engine(spec, loops)
    model = plan_model(spec)
    pod = spec.pod
    env = [
        {
            "name": names.ADMIN_TOKEN_ENV,
            "valueFrom": {
                "secretKeyRef": {"name": secret_name(owner.name), "key": SECRET_TOKEN_KEY}
            },
        }
    ]
    if spec.model.source.startswith("hf://"):
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})  # pre-cached: never download
    env += [e.to_api() for e in pod.env]

    volumes = list(pod.volumes)
    mounts = list(pod.volume_mounts)
    if model.pvc:
        volumes.insert(
            0,
            {
                "name": MODEL_VOLUME,
                "persistentVolumeClaim": {"claimName": model.pvc, "readOnly": True},
            },
        )
        mounts.insert(
            0,
            {
                "name": MODEL_VOLUME,
                "mountPath": f"{MODEL_MOUNT_ROOT}/{model.pvc}",
                "readOnly": True,
            },
        )

    container: dict = {
        "name": CONTAINER,
        "image": image,
        "command": ["batchpilot", "serve"],
        "args": server_args(spec, engine, model),
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        "env": env,
        "readinessProbe": _probe("/ready", period=5, failures=3, timeout=2),
        "livenessProbe": _probe("/health", period=10, failures=6, timeout=5),
        # Loading weights can take minutes: liveness starts once /health first answers.
        "startupProbe": _probe("/health", period=5, failures=180, timeout=5),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    resources = {
        k: {n: str(q) for n, q in v.items()} for k, v in spec.resources.to_api().items() if v
    }
    if resources:
        container["resources"] = resources
    if spec.server.pre_stop_sleep_seconds:
        # Endpoints drop the pod while it still serves; then SIGTERM starts the drain.
        container["lifecycle"] = {
            "preStop": {"sleep": {"seconds": spec.server.pre_stop_sleep_seconds}}
        }
    if mounts:
        container["volumeMounts"] = mounts

    pod_spec: dict = {
        "containers": [container],
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

    labels = {**pod.labels, **common_labels(owner.name)}
    annotations = {
        **pod.annotations,
        **scrape_annotations(),
        ANN_TOKEN_HASH: token_hash(admin_token),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, owner.name),
        "spec": {
            "replicas": desired_replicas(spec, loops),
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": 1200,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def build_children(
    owner: Owner,
    spec: InferenceServiceSpec,
    *,
    image: str,
    admin_token: str,
    loops: LoopState = LoopState(),
) -> list[dict]:
    """Every child, in apply order: the Deployment last, after the Secret it reads."""
    return [
        build_secret(owner, admin_token),
        build_service(owner),
        build_pdb(owner),
        build_deployment(owner, spec, image=image, admin_token=admin_token, loops=loops),
    ]


def contains(actual: object, desired: object) -> bool:
    """Does ``actual`` carry every field of ``desired`` with the same value? Maps may have
    more keys (server defaults, other managers' fields); lists match element-wise."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            k in actual and contains(actual[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(contains(a, d) for a, d in zip(actual, desired, strict=True))
        )
    return actual == desired


def drifted(desired: dict, actual: dict) -> bool:
    """Has someone changed what the operator applied? For a Deployment only its metadata is
    compared here (the server normalizes its pod template); spec edits show as a new
    metadata.generation, which the handlers track."""
    meta_keys = ("labels", "annotations", "ownerReferences")
    want = {"metadata": {k: v for k, v in desired["metadata"].items() if k in meta_keys}}
    if desired["kind"] != "Deployment":
        want |= {k: v for k, v in desired.items() if k not in ("metadata", "apiVersion", "kind")}
    return not contains(actual, want)


# What each kind declares besides metadata: the parts the operator owns outright.
_OWNED_PARTS = ("spec", "data", "type")
# Values the API server allocates once and keeps: carried over from the live object when
# the declared parts are replaced.
_ALLOCATED = {"Service": ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy")}


def foreign_managers(live: dict, manager: str) -> list[str]:
    """Field managers other than ``manager`` that own part of a child's declared content
    (fields someone added by hand: server-side apply keeps those, it only forces the fields
    the operator sets). Status writers do not count."""
    out = []
    for entry in live.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") == manager or entry.get("subresource") == "status":
            continue
        owned = entry.get("fieldsV1") or {}
        if any(f"f:{part}" in owned for part in (*_OWNED_PARTS, "stringData")):
            out.append(entry.get("manager", "?"))
    return out


def restored(live: dict, desired: dict) -> dict:
    """The live object with the declared parts replaced wholesale by the desired ones: a
    full update (PUT) of this drops whatever others added there."""
    body = {k: v for k, v in live.items() if k not in ("status", *_OWNED_PARTS, "stringData")}
    body["metadata"] = {k: v for k, v in live["metadata"].items() if k != "managedFields"}
    for part in _OWNED_PARTS:
        if part in desired:
            body[part] = desired[part]
    for key in _ALLOCATED.get(desired["kind"], ()):
        if key in (live.get("spec") or {}):
            body["spec"] = {**body["spec"], key: live["spec"][key]}
    return body
