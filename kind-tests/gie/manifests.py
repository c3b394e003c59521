"""The Gateway API Inference Extension's endpoint picker (EPP, v1.5.0) for one InferencePool, as
Kubernetes objects: ``epp_objects(namespace, pool, image)``.

Written from GIE's own chart (config/charts/epplib + inferencepool in the module): the same
read-only RBAC, ports and probes, with these choices for a test cluster:

- plain gRPC (``--secure-serving=false``): the ext-proc client speaks plaintext;
- ``--metrics-endpoint-auth=false``: the metrics port needs no TokenReview or
  SubjectAccessReview, so a namespaced Role is all the EPP needs;
- ``--tracing=false`` (no OTLP collector); no leader election (one replica);
- a scheduling profile of the queue and KV-cache scorers only (``CONFIG``): GIE's default also
  has the prefix-cache scorer (weight 3), which sends a repeated prompt back to the pod that
  served it, whatever its load;
- ``-v 4`` by default: the "Calculated score" line per scorer and pod; ``-v 5`` adds the
  per-pod metrics dump every 5 s ("Current Pods and metrics gathered").

Only the InferencePool CRD (``inference.networking.k8s.io``) is required: the EPP looks for
the InferenceObjective and InferenceModelRewrite CRDs (``inference.networking.x-k8s.io``)
through discovery and runs without them.
"""

from __future__ import annotations

GRPC_PORT = 9002
HEALTH_PORT = 9003
METRICS_PORT = 9090
POOL_GROUP = "inference.networking.k8s.io"
RUN_AS = 65532  # the image's USER

# GIE's EndpointPickerConfig: queue depth and KV-cache utilisation, equal weights, the
# max-score picker (random among ties). The data layer (the metrics-data-source scraping each
# pod's /metrics on the pool's target port, with the vLLM metric names) and the OpenAI parser
# are GIE's defaults, added by its loader when the config leaves them out.
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: max-score-picker
"""


def epp_name(pool: str) -> str:
    return f"{pool}-epp"


def epp_args(namespace: str, pool: str, verbosity: int = 4, config: str = CONFIG) -> list[str]:
    return [
        f"--pool-name={pool}",
        f"--pool-namespace={namespace}",
        f"--pool-group={POOL_GROUP}",
        f"--grpc-port={GRPC_PORT}",
        f"--grpc-health-port={HEALTH_PORT}",
        f"--metrics-port={METRICS_PORT}",
        "--secure-serving=false",
        "--metrics-endpoint-auth=false",
        "--tracing=false",
        "--enable-pprof=false",
        f"--v={verbosity}",
        f"--config-text={config}",
    ]


def _rbac(namespace: str, name: str, labels: dict) -> list[dict]:
    read = ["get", "list", "watch"]
    meta = {"name": name, "namespace": namespace, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": read},
                {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": read},
                {
                    "apiGroups": ["inference.networking.x-k8s.io"],
                    "resources": ["inferenceobjectives", "inferencemodelrewrites"],
                    "verbs": read,
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        },
    ]


def _container(namespace: str, pool: str, image: str, verbosity: int, config: str) -> dict:
    # With leader election off, the health service answers SERVING for any service name once
    # the InferencePool is synced.
    probe = {"grpc": {"port": HEALTH_PORT, "service": "inference-extension"}}
    return {
        "name": "epp",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": epp_args(namespace, pool, verbosity, config),
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT},
            {"name": "grpc-health", "containerPort": HEALTH_PORT},
            {"name": "metrics", "containerPort": METRICS_PORT},
        ],
        "livenessProbe": {**probe, "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {**probe, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


def epp_objects(
    namespace: str, pool: str, image: str, verbosity: int = 4, config: str = CONFIG
) -> list[dict]:
    """ServiceAccount, Role, RoleBinding, Deployment and Service ``<pool>-epp`` (grpc 9002,
    metrics 9090) of an EPP serving the InferencePool ``pool`` in ``namespace``; ``image`` is
    kind-tests/gie/build.sh's ``batchpilot-gie-epp:<GIE_VERSION>`` (loaded into the cluster,
    never pulled)."""
    name = epp_name(pool)
    selector = {"app.kubernetes.io/name": name}
    labels = {**selector, "app.kubernetes.io/component": "endpoint-picker"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            # One active EPP at a time (GIE's chart): the old one goes before the new starts.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": name,
                    "terminationGracePeriodSeconds": 10,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [_container(namespace, pool, image, verbosity, config)],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "http2"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }
    return [*_rbac(namespace, name, labels), deployment, service]
