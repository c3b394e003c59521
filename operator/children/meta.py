"""What every child shares: its owner, its labels and metadata, the server's ports."""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot import names
from batchpilot.operator.crd.api import API_VERSION, KIND

PORT = names.DEFAULT_PORT
PORT_NAME = "http"
# /admin/* listens here only; the Service does not expose it, the operator calls each pod.
ADMIN_PORT = names.DEFAULT_ADMIN_PORT
ADMIN_PORT_NAME = "admin"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SERVICE = "batchpilot.dev/service"
APP_NAME = "batchpilot-server"
MANAGED_BY = "batchpilot-operator"
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"


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


def child_metadata(owner: Owner, name: str, annotations: dict | None = None) -> dict:
    meta = {
        "name": name,
        "namespace": owner.namespace,
        "labels": common_labels(owner.name),
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def scrape_annotations() -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
    }
