"""The endpoint picker the operator runs for a service (spec.routing.endpointPicker with
deploy or image): GIE v1.5.0's EPP as its own chart (config/charts/epplib, inferencepool)
deploys it: ServiceAccount, Role and RoleBinding with the chart's read-only rules,
ConfigMap (the EndpointPickerConfig), Service (ext-proc 9002, metrics 9090) and a
Deployment of one active picker (Recreate), probed over gRPC on its health port.

Choices beyond the chart's: the restricted Pod Security Standard with a read-only root
filesystem (a /tmp emptyDir), and ``--metrics-endpoint-auth=false``, as the chart sets
without its Prometheus option, so that the picker needs no cluster-wide TokenReview and
SubjectAccessReview rights (its metrics port answers anyone in the cluster network).
"""

from __future__ import annotations

import hashlib

from batchpilot.operator.children.config_map import config_map_name
from batchpilot.operator.children.meta import (
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    LABEL_SERVICE,
    MANAGED_BY,
    Owner,
    child_metadata,
)
from batchpilot.operator.children.picker_config import picker_config, render_config
from batchpilot.operator.children.pod import termination_grace_seconds
from batchpilot.operator.crd.routing import EndpointPickerSpec
from batchpilot.operator.crd.spec import InferenceServiceSpec

PICKER_APP = "batchpilot-endpoint-picker"
PICKER_COMPONENT = "endpoint-picker"
CONTAINER = "epp"
GRPC_PORT, HEALTH_PORT, METRICS_PORT = 9002, 9003, 9090
POOL_GROUP = "inference.networking.k8s.io"
CONFIG_DIR, CONFIG_KEY = "/config", "epp.yaml"
ANN_CONFIG = "batchpilot.dev/epp-config-sha256"  # a config change rolls the picker
RUN_AS = 65532  # GIE's image's USER (distroless nonroot)
# A picker that cannot start (its image not pulled, crash-looping) shows as Degraded
# after this long: it starts in seconds when it can.
PROGRESS_DEADLINE_SECONDS = 180
RBAC_API = "rbac.authorization.k8s.io/v1"
# Its children's kinds, in apply order: the account and its rights before the pods.
PICKER_KINDS = (
    ("v1", "ServiceAccount"),
    (RBAC_API, "Role"),
    (RBAC_API, "RoleBinding"),
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
)
READ = ["get", "list", "watch"]
# GIE's chart's Role rules for the EPP: the pool's pods, the pool, its objectives and
# rewrites (the x-k8s.io ones are looked up through discovery; absent CRDs are fine).
PICKER_RULES: list[dict] = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": READ},
    {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": READ},
    {"apiGroups": ["inference.networking.x-k8s.io"],
     "resources": ["inferenceobjectives", "inferencemodelrewrites"], "verbs": READ},
]  # fmt: skip
# With more than one replica, the chart's leader-election Role: one picks, the rest wait.
LEADER_ELECTION_RULES: list[dict] = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "verbs": [*READ, "create", "update", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
]  # fmt: skip


def picker_name(owner: Owner, epp: EndpointPickerSpec) -> str:
    """Every picker object's name: endpointPicker.name, else `<service>-epp` (the service's
    name cut so that it stays a 63-character label)."""
    return epp.name or f"{owner.name[:59]}-epp"


def name_problem(owner: Owner, epp: EndpointPickerSpec) -> str | None:
    """A picker name that is one of the server's own children's (its Service and Deployment,
    its ConfigMap) would have two children fight over one object."""
    if picker_name(owner, epp) in (owner.name, config_map_name(owner.name)):
        return (
            f"spec.routing.endpointPicker.name {epp.name!r} is taken by the server's own "
            "objects: choose another"
        )
    return None


def picker_selector(owner: Owner) -> dict[str, str]:
    """The picker's pods: never the server's (whose selector names APP_NAME)."""
    return {LABEL_NAME: PICKER_APP, LABEL_SERVICE: owner.name}


def picker_labels(owner: Owner) -> dict[str, str]:
    return {
        **picker_selector(owner),
        LABEL_INSTANCE: owner.name,
        LABEL_COMPONENT: PICKER_COMPONENT,
        LABEL_PART_OF: "batchpilot",
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def owned_selector(owner: Owner) -> str:
    """A label selector for every picker object the service may have, whatever its name."""
    return f"{LABEL_SERVICE}={owner.name},{LABEL_COMPONENT}={PICKER_COMPONENT}"


def _metadata(owner: Owner, name: str) -> dict:
    return {**child_metadata(owner, name), "labels": picker_labels(owner)}


def picker_rules(epp: EndpointPickerSpec) -> list[dict]:
    return PICKER_RULES + (LEADER_ELECTION_RULES if epp.replicas > 1 else [])


def build_rbac(owner: Owner, epp: EndpointPickerSpec) -> list[dict]:
    """The picker's ServiceAccount, Role and RoleBinding."""
    name = picker_name(owner, epp)
    meta = _metadata(owner, name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": RBAC_API, "kind": "Role", "metadata": meta, "rules": picker_rules(epp)},
        {
            "apiVersion": RBAC_API,
            "kind": "RoleBinding",
            "metadata": meta,
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
            "roleRef": {"apiGroup": RBAC_API.split("/")[0], "kind": "Role", "name": name},
        },
    ]


def build_picker_config_map(owner: Owner, spec: InferenceServiceSpec, epp: EndpointPickerSpec):
    text = render_config(picker_config(owner, spec, epp))
    meta = _metadata(owner, picker_name(owner, epp))
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {CONFIG_KEY: text}}


def build_picker_service(owner: Owner, epp: EndpointPickerSpec) -> dict:
    """ext-proc on endpointPicker.port (the pool's endpointPickerRef) and the metrics."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, picker_name(owner, epp)),
        "spec": {
            "type": "ClusterIP",
            "selector": picker_selector(owner),
            "ports": [
                {"name": "grpc-ext-proc", "protocol": "TCP", "port": epp.port,
                 "targetPort": "grpc"},
                {"name": "http-metrics", "protocol": "TCP", "port": METRICS_PORT,
                 "targetPort": "metrics"},
            ],
        },
    }  # fmt: skip


def picker_args(owner: Owner, epp: EndpointPickerSpec) -> list[str]:
    """GIE v1.5.0's EPP flags (pkg/epp/server/options.go), as its chart passes them."""
    args = [
        f"--pool-name={owner.name}",
        f"--pool-namespace={owner.namespace}",
        f"--pool-group={POOL_GROUP}",
        f"--grpc-port={GRPC_PORT}",
        f"--grpc-health-port={HEALTH_PORT}",
        f"--metrics-port={METRICS_PORT}",
        f"--config-file={CONFIG_DIR}/{CONFIG_KEY}",
        "--metrics-endpoint-auth=false",
        "--tracing=false",
        "--zap-encoder=json",
        f"--v={epp.verbosity}",
    ]
    return args + (["--ha-enable-leader-election"] if epp.replicas > 1 else [])


def _probe(epp: EndpointPickerSpec, check: str) -> dict:
    """The health service answers for the pool once synced; with leader election, for
    liveness (any replica) and readiness (the leader only) apart, as GIE's chart probes."""
    service = check if epp.replicas > 1 else "inference-extension"
    return {"grpc": {"port": HEALTH_PORT, "service": service}}


def security_context() -> dict:
    """The restricted Pod Security Standard, with a read-only root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def build_picker_container(owner: Owner, epp: EndpointPickerSpec) -> dict:
    container = {
        "name": CONTAINER,
        "image": epp.image,
        "args": picker_args(owner, epp),
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "livenessProbe": {**_probe(epp, "liveness"), "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {**_probe(epp, "readiness"), "periodSeconds": 2},
        "resources": {
            k: {n: str(q) for n, q in v.items()} for k, v in epp.resources.to_api().items() if v
        },
        "securityContext": security_context(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if epp.image_pull_policy:
        container["imagePullPolicy"] = epp.image_pull_policy
    return container


def build_picker_deployment(
    owner: Owner, spec: InferenceServiceSpec, epp: EndpointPickerSpec, config: dict
) -> dict:
    """``config``: its ConfigMap, whose digest in the template rolls the picker when the
    config changes (the EPP reads it once, at start)."""
    name = picker_name(owner, epp)
    digest = hashlib.sha256(config["data"][CONFIG_KEY].encode()).hexdigest()
    pod_spec = {
        "serviceAccountName": name,
        # The server's drain time: a picker going away never outlives a request in flight.
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [build_picker_container(owner, epp)],
        "volumes": [
            {"name": "config", "configMap": {"name": name}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, name),
        "spec": {
            "replicas": epp.replicas,
            # One active picker at a time (GIE's chart): the old one goes before the new one.
            "strategy": {"type": "Recreate"},
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "selector": {"matchLabels": picker_selector(owner)},
            "template": {
                "metadata": {"labels": picker_labels(owner), "annotations": {ANN_CONFIG: digest}},
                "spec": pod_spec,
            },
        },
    }


def picker_children(owner: Owner, spec: InferenceServiceSpec) -> list[dict]:
    """The deployed picker's objects in PICKER_KINDS' order; none unless it is asked for."""
    epp = spec.routing.picker
    if epp is None:
        return []
    config = build_picker_config_map(owner, spec, epp)
    return [
        *build_rbac(owner, epp),
        config,
        build_picker_service(owner, epp),
        build_picker_deployment(owner, spec, epp, config),
    ]
