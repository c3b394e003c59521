"""spec.pod and spec.resources: the server pods' pass-through settings (core/v1 shapes)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from batchpilot.operator.crd.base import (
    CamelModel,
    DNS1123Subdomain,
    K8sSchema,
    Opaque,
    Quantity,
    Rule,
)


class Toleration(CamelModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(CamelModel):
    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: Opaque | None = None


class LocalObjectReference(CamelModel):
    name: str


# The volume sources the restricted Pod Security Standard admits: hostPath and the other
# node-level sources are refused by the CRD, whatever the namespace enforces.
VOLUME_SOURCES = (
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
)
# A core/v1 Volume with only these sources declared: any other source (hostPath...) is an
# unknown field, refused by strict field validation or pruned, and then the volume has no
# source and fails the rule below. The API server validates each source's body when the
# operator applies the Deployment.
Volume = Annotated[
    dict[str, Any],
    K8sSchema(
        {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "maxLength": 63},
                **{
                    s: {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    for s in VOLUME_SOURCES
                },
            },
        }
    ),
]
_ONE_VOLUME_SOURCE_CEL = (
    "[" + ", ".join(f"has(v.{s})" for s in VOLUME_SOURCES) + "].filter(b, b).size() == 1"
)


def _one_allowed_source(volume: dict) -> bool:
    keys = set(volume) - {"name"}
    return len(keys) == 1 and keys <= set(VOLUME_SOURCES)


class PodSpec(CamelModel):
    """Pass-through settings of the server pods (core/v1 names and shapes). The security
    context is the operator's (the restricted Pod Security Standard) and cannot be set."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    affinity: Opaque | None = None
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    service_account_name: DNS1123Subdomain | None = None
    """A ServiceAccount of the namespace for the pods. Only one labelled
    batchpilot.dev/inference-server=allowed: whoever may label ServiceAccounts decides which
    ones InferenceServices may run as. Default: the namespace's default, with no API token
    mounted."""
    annotations: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    priority_class_name: str | None = None
    volumes: list[Volume] = Field(default_factory=list, max_length=64)
    """Extra volumes, e.g. a Hugging Face cache for hf:// sources: configMap, csi,
    downwardAPI, emptyDir, ephemeral, image, persistentVolumeClaim, projected or secret
    (what the restricted Pod Security Standard admits; never hostPath)."""
    volume_mounts: list[Opaque] = Field(default_factory=list, max_length=64)
    """Mounts of the extra volumes into the server container."""

    rules = (
        Rule(
            cel=f"!has(self.volumes) || self.volumes.all(v, {_ONE_VOLUME_SOURCE_CEL})",
            message="pod.volumes: each volume needs exactly one source, of "
            + ", ".join(VOLUME_SOURCES)
            + " (the restricted Pod Security Standard's list; hostPath and other node "
            "volumes are refused)",
            check=lambda p: all(_one_allowed_source(v) for v in p.volumes),
            field_path=".volumes",
        ),
    )


# vLLM accepts any model id as an adapter's name; bounded here to what reads well in a
class ResourceRequirements(CamelModel):
    """core/v1 ResourceRequirements of the server container, e.g. limits nvidia.com/gpu: 1."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)
