"""The server pod: its container (args, env, probes, volumes), the restricted Pod Security
Standard, and the pod template the Deployment runs."""

from __future__ import annotations

import hashlib
import math

from batchpilot import names
from batchpilot.operator.children.config_map import LORA_MODULES_KEY, config_map_name
from batchpilot.operator.children.engine_args import (
    KV_EVENTS_PORT,
    KV_EVENTS_PORT_NAME,
    MAX_NUM_SEQS_ENV,
    POD_IP_ENV,
    engine_args,
    kv_events_args,
)
from batchpilot.operator.children.meta import (
    ADMIN_PORT,
    ADMIN_PORT_NAME,
    PORT,
    PORT_NAME,
    Owner,
    common_labels,
    scrape_annotations,
)
from batchpilot.operator.children.plan import (
    MODEL_MOUNT_ROOT,
    ModelPlan,
    adapter_claims,
    lora_enabled,
    plan_adapter_resolver,
    plan_model,
)
from batchpilot.operator.children.quantity import parse_quantity
from batchpilot.operator.children.secret import SECRET_TOKEN_KEY, secret_name
from batchpilot.operator.crd.engine import EngineSpec
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.flags import LORA_RESOLVER_DIR

CONTAINER = "server"
MODEL_VOLUME = "model"
# Volumes of adapter claims other than the model's: named after a hash of the claim, so
# that reordering or adding adapters leaves the other volumes' names, and the pods, alone.
ADAPTER_VOLUME_PREFIX = "adapters-"
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
# The variables the operator sets in the server container: pod.env may not.
RESERVED_ENV = frozenset([names.ADMIN_TOKEN_ENV, MAX_NUM_SEQS_ENV, names.LORA_MODULES_ENV])
# A CPU pod's thread budget (server/platform/cpu_budget.py): from its CPU limit, else its request.
# The server reads a limit itself (the CFS quota), but not a request, which leaves it no
# quota: without this variable a pod requesting 2 CPUs on a 64-CPU node ran 64 threads. Not
# set where the user's pod.env sets it or OMP_NUM_THREADS: theirs wins.
CPU_THREADS_OVERRIDES = frozenset([names.CPU_THREADS_ENV, "OMP_NUM_THREADS"])


def spec_problems(spec: InferenceServiceSpec) -> list[str]:
    """What the schema cannot express but the operator rejects before building anything
    (engine.extraArgs are checked by the schema's own rule)."""
    problems = []
    reserved = RESERVED_ENV | ({POD_IP_ENV} if spec.routing.precise_prefix else set())
    for env in spec.pod.env:
        if env.name in reserved:
            problems.append(f"spec.pod.env: {env.name} is set by the operator")
    return problems


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
        *resolver_args(spec),
        *(kv_events_args(model.served_name) if spec.routing.precise_prefix else []),
        *slo_args(spec),
        "--max-queue-len",
        str(s.max_queue_len),
        "--shutdown-timeout",
        str(s.shutdown_timeout_seconds),
        *engine.extra_args,
    ]


def slo_args(spec: InferenceServiceSpec) -> list[str]:
    """spec.slo's targets, on tuned services only: the server counts each request against
    them and the tuner's score reads the counts. Other templates stay as they were."""
    if not spec.tuning.enabled:
        return []
    targets = (
        (names.SLO_TTFT_FLAG, spec.ttft_target_seconds),
        (names.SLO_TPOT_FLAG, spec.itl_target_seconds),
    )
    return [f"{flag}={seconds:g}" for flag, seconds in targets]


def resolver_args(spec: InferenceServiceSpec) -> list[str]:
    """--lora-resolver-dir with spec.adapterResolver (its claim is among adapter_claims,
    mounted read-only); nothing without one, so that other templates stay as they were."""
    resolver = plan_adapter_resolver(spec)
    return [LORA_RESOLVER_DIR, resolver[0]] if resolver is not None else []


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
    if spec.routing.precise_prefix:  # the KV events' topic names the pod by it
        ip = {"fieldRef": {"fieldPath": "status.podIP"}}
        env.append({"name": POD_IP_ENV, "valueFrom": ip})
    return env + [e.to_api() for e in spec.pod.env]


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


def kv_events_ports(spec: InferenceServiceSpec) -> list[dict]:
    if not spec.routing.precise_prefix:
        return []
    return [{"name": KV_EVENTS_PORT_NAME, "containerPort": KV_EVENTS_PORT, "protocol": "TCP"}]


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
        "args": server_args(spec, engine, plan_model(spec, image)),
        "ports": [
            {"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"},
            {"name": ADMIN_PORT_NAME, "containerPort": ADMIN_PORT, "protocol": "TCP"},
            *kv_events_ports(spec),
        ],
        "env": server_env(owner, spec, token),
        # Probed every second (the kubelet's shortest period): a replica woken from zero
        # serves what the activator holds as soon as it is Ready, and each period is up to
        # that much more of a cold start (at 5 s the kubelet took 2.7 s on average to see
        # it). 16 failures: the same 16 s a busy CPU server may go without answering before
        # it drops out.
        "readinessProbe": _probe("/ready", period=1, failures=16, timeout=2),
        "livenessProbe": _probe("/health", period=10, failures=6, timeout=5),
        # Loading weights can take minutes: liveness starts once /health first answers.
        # Readiness is probed only after this succeeds, so its period delays Ready too;
        # /health answers while the model loads, so 900 one-second tries give 15 minutes.
        "startupProbe": _probe("/health", period=1, failures=900, timeout=5),
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
    volumes, mounts = model_volumes(spec, plan_model(spec, image))
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
