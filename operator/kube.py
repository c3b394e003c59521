"""The operator's few Kubernetes API calls, on plain dicts (the I/O shell of the builders)."""

from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client, config

from batchpilot.operator.config import FIELD_MANAGER
from batchpilot.operator.crd import GROUP, PLURAL, VERSION

ApiException = client.ApiException

# (apiVersion, kind) -> (API class, the suffix of its read_/patch_ methods)
_KINDS = {
    ("v1", "Secret"): (client.CoreV1Api, "namespaced_secret"),
    ("v1", "Service"): (client.CoreV1Api, "namespaced_service"),
    ("policy/v1", "PodDisruptionBudget"): (client.PolicyV1Api, "namespaced_pod_disruption_budget"),
    ("apps/v1", "Deployment"): (client.AppsV1Api, "namespaced_deployment"),
}
APPLY = "application/apply-patch+yaml"  # JSON is YAML: the client sends the dict as JSON
MERGE = "application/merge-patch+json"
TIMEOUT = (10, 30)  # connect, read seconds


def _json(resp: Any) -> dict:
    return json.loads(resp.data)


def load_configuration() -> client.Configuration:
    """In-cluster credentials when running in a pod, else $KUBECONFIG (read now: the
    client library reads it once, at import) or ~/.kube/config."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None,
            client_configuration=configuration,
        )
    configuration.connection_pool_maxsize = 32  # handlers run in a thread pool
    return configuration


def new_api_client() -> client.ApiClient:
    return client.ApiClient(load_configuration())


class Kube:
    def __init__(self, api: client.ApiClient, field_manager: str = FIELD_MANAGER):
        self.api = api
        self.field_manager = field_manager
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def _methods(self, api_version: str, kind: str) -> tuple[Any, str]:
        cls, suffix = _KINDS[(api_version, kind)]
        return cls(self.api), suffix

    def apply(self, obj: dict, *, dry_run: bool = False) -> dict:
        """Server-side apply under the operator's field manager, forcing conflicts: fields
        the operator sets are the operator's, whoever edited them since. A dry run only
        validates (admission included) and persists nothing."""
        return self._write(
            "patch", obj, force=True, dry_run="All" if dry_run else None, _content_type=APPLY
        )

    def replace(self, obj: dict) -> dict:
        """A full update (PUT) under the operator's field manager; ``obj`` carries the
        resourceVersion it was computed from, so a concurrent change fails with 409."""
        return self._write("replace", obj)

    def _write(self, verb: str, obj: dict, **options) -> dict:
        api, suffix = self._methods(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        resp = getattr(api, f"{verb}_{suffix}")(
            meta["name"],
            meta["namespace"],
            obj,
            field_manager=self.field_manager,
            _preload_content=False,
            _request_timeout=TIMEOUT,
            **options,
        )
        return _json(resp)

    def read(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        api, suffix = self._methods(api_version, kind)
        try:
            resp = getattr(api, f"read_{suffix}")(
                name, namespace, _preload_content=False, _request_timeout=TIMEOUT
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return _json(resp)

    def read_isvc(self, namespace: str, name: str) -> dict | None:
        try:
            resp = self.custom.get_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                _preload_content=False,
                _request_timeout=TIMEOUT,
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return _json(resp)

    def patch_isvc_status(self, namespace: str, name: str, status: dict) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": status},
            _content_type=MERGE,
            _preload_content=False,
            _request_timeout=TIMEOUT,
        )

    def _exists(self, fn: Any, namespace: str, name: str) -> bool:
        try:
            fn(name, namespace, _preload_content=False, _request_timeout=TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    def pvc_exists(self, namespace: str, name: str) -> bool:
        return self._exists(self.core.read_namespaced_persistent_volume_claim, namespace, name)

    def service_account_exists(self, namespace: str, name: str) -> bool:
        return self._exists(self.core.read_namespaced_service_account, namespace, name)
