"""The model cache's objects: the claim the operator creates when it is absent, and the Job
that fills it once per model (spec.model.cache). Pure builders, like the other children."""

from __future__ import annotations

import hashlib

from batchpilot.operator.children.meta import (
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    MANAGED_BY,
    Owner,
    owner_reference,
)
from batchpilot.operator.children.plan import MODEL_MOUNT_ROOT, cache_path
from batchpilot.operator.children.pod import (
    SCRATCH_ENV,
    SCRATCH_VOLUMES,
    container_security_context,
    pod_security_context,
)
from batchpilot.operator.crd.spec import InferenceServiceSpec

FILL_CONTAINER = "fill"
CACHE_VOLUME = "model-cache"
LABEL_CACHE = "batchpilot.dev/model-cache"  # on the claim: its name; on a Job: the claim's
# Not batchpilot-server: the serving Deployment's, Service's and PDB's selectors must never
# pick a fill pod.
CACHE_APP_NAME = "batchpilot-model-cache"
CACHE_COMPONENT = "model-cache"
JOB_KIND = ("batch/v1", "Job")
# Retries of a failed fill before the Job fails, and the most one Job may run: a model
# copied or converted in an hour or never.
FILL_BACKOFF_LIMIT = 2
FILL_DEADLINE_SECONDS = 3600


def cache_labels(claim: str) -> dict[str, str]:
    """The claim's labels; a fill Job's add its service (LABEL_INSTANCE)."""
    return {
        LABEL_NAME: CACHE_APP_NAME,
        LABEL_COMPONENT: CACHE_COMPONENT,
        LABEL_PART_OF: "batchpilot",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_CACHE: claim,
    }


def fill_job_selector(owner_name: str) -> str:
    """The fill Jobs of one service (its stale ones are found by it)."""
    return f"{LABEL_INSTANCE}={owner_name},{LABEL_COMPONENT}={CACHE_COMPONENT}"


def fill_job_name(owner: Owner, path: str) -> str:
    """One Job per service and cached model: a new source or image is a new Job (a Job's
    pod template cannot change). At most 63 characters, as the Job's pods carry its name
    in a label."""
    digest = hashlib.sha256(f"{owner.name}\n{path}".encode()).hexdigest()[:10]
    return f"{owner.name[:46]}-cache-{digest}"


def build_cache_claim(owner: Owner, spec: InferenceServiceSpec) -> dict:
    """The claim, to create when none of its name exists. Without an owner reference: the
    cache outlives the services that use it and is shared by the namespace's services."""
    cache = spec.model.cache
    assert cache is not None
    claim_spec: dict = {
        "accessModes": list(cache.access_modes),
        "resources": {"requests": {"storage": str(cache.size)}},
    }
    if cache.storage_class_name:
        claim_spec["storageClassName"] = cache.storage_class_name
    labels = cache_labels(cache.claim_name)  # not any one service's
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": cache.claim_name, "namespace": owner.namespace, "labels": labels},
        "spec": claim_spec,
    }


def fill_env(spec: InferenceServiceSpec) -> list[dict]:
    """The writable places, offline Hugging Face, then the user's (an HF_HOME of theirs
    is where an hf:// source is found, as for the server)."""
    env = [{"name": k, "value": v} for k, v in SCRATCH_ENV]
    env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    return env + [e.to_api() for e in spec.pod.env]


def fill_resources(spec: InferenceServiceSpec) -> dict:
    """The server's CPU and memory (a conversion holds the model in memory), no GPU."""
    kept = ("cpu", "memory", "ephemeral-storage")
    out = {}
    for part, amounts in spec.resources.to_api().items():
        picked = {n: str(q) for n, q in amounts.items() if n in kept}
        if picked:
            out[part] = picked
    return out


def fill_container(spec: InferenceServiceSpec, image: str, path: str, mounts: list) -> dict:
    container: dict = {
        "name": FILL_CONTAINER,
        "image": image,
        "command": ["batchpilot", "model", "cache"],
        "args": ["--source", spec.model.source, "--output", path],
        "env": fill_env(spec),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if resources := fill_resources(spec):
        container["resources"] = resources
    return container


def fill_pod_spec(spec: InferenceServiceSpec, container: dict, volumes: list) -> dict:
    """Scheduled like the server pods (a ReadWriteOnce claim is then on their node), the
    restricted Pod Security Standard, no API credentials."""
    pod = spec.pod
    pod_spec: dict = {
        "restartPolicy": "Never",
        "containers": [container],
        "securityContext": pod_security_context(),
        "automountServiceAccountToken": False,
        "volumes": volumes,
    }
    for key, value in (
        ("nodeSelector", dict(pod.node_selector)),
        ("tolerations", [t.to_api() for t in pod.tolerations]),
        ("affinity", pod.affinity),
        ("imagePullSecrets", [r.to_api() for r in pod.image_pull_secrets]),
    ):
        if value:
            pod_spec[key] = value
    return pod_spec


def build_fill_job(owner: Owner, spec: InferenceServiceSpec, image: str) -> dict:
    """The Job that writes the model into its cache directory, the claim mounted read-write
    (the replicas mount it read-only). The user's volumes come along: a path source may be
    on one of them."""
    cache = spec.model.cache
    path = cache_path(spec, image)
    assert cache is not None and path is not None
    claim = cache.claim_name
    volumes = [{"name": n, "emptyDir": {}} for n, _ in SCRATCH_VOLUMES]
    mounts = [{"name": n, "mountPath": p} for n, p in SCRATCH_VOLUMES]
    volumes.append({"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
    mounts.append({"name": CACHE_VOLUME, "mountPath": f"{MODEL_MOUNT_ROOT}/{claim}"})
    volumes += list(spec.pod.volumes)
    mounts += [{**m, "readOnly": True} for m in spec.pod.volume_mounts]
    labels = {**cache_labels(claim), LABEL_INSTANCE: owner.name}
    container = fill_container(spec, image, path, mounts)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": fill_job_name(owner, path),
            "namespace": owner.namespace,
            "labels": labels,
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": {
            "backoffLimit": FILL_BACKOFF_LIMIT,
            "activeDeadlineSeconds": FILL_DEADLINE_SECONDS,
            "template": {
                "metadata": {"labels": labels},
                "spec": fill_pod_spec(spec, container, volumes),
            },
        },
    }
