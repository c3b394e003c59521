"""The operator's few Kubernetes API calls, on plain dicts (the I/O shell of the builders).

Every kind goes through ``kubernetes.dynamic.DynamicClient``: the API server's discovery
maps (apiVersion, kind) to a REST path, so a new child kind needs no code here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from typing import Any

import kopf
import urllib3
from kubernetes import client, config, dynamic
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from batchpilot.operator import probes
from batchpilot.operator.bounds import clip
from batchpilot.operator.config import FIELD_MANAGER
from batchpilot.operator.crd.api import API_VERSION, KIND

ApiException = client.ApiException

MERGE = "application/merge-patch+json"
TIMEOUT = (10, 30)  # connect, read seconds
# A kind the API server does not serve (KEDA not installed) is looked up again after this:
# each miss costs the discovery client a full rediscovery.
UNSERVED_RETRY_SECONDS = 60.0

log = logging.getLogger("batchpilot.operator")


def finite(value: Any, path: str = "") -> tuple[Any, list[str]]:
    """``value`` with every infinite or NaN number replaced by None, and where they were.
    JSON has no infinity: the API server refuses a whole patch that carries one, and a
    status that cannot be written stops the loop's memory (a CI run lost 15 minutes)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, [path or "."]
    if isinstance(value, dict):
        pairs = {k: finite(v, f"{path}.{k}") for k, v in value.items()}
        return {k: v for k, (v, _) in pairs.items()}, [p for _, ps in pairs.values() for p in ps]
    if isinstance(value, list | tuple):
        items = [finite(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return [v for v, _ in items], [p for _, ps in items for p in ps]
    return value, []


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
    # Handlers (16), the builds' child reads (16), the status refreshes (16) and the loop's
    # calls (16) run on threads: a pool smaller than them discards connections, and each
    # new one is a TLS handshake.
    configuration.connection_pool_maxsize = 64
    return configuration


def new_api_client() -> client.ApiClient:
    return client.ApiClient(load_configuration())


def wait_until_served(kinds: list[tuple[str, str]], timeout: float) -> None:
    """Block until the API server's discovery lists every (apiVersion, kind). Kopf looks
    its resources up once, at start: an operator started while kube-apiserver restarted
    got an incomplete discovery and watched nothing, for good (a cluster test saw it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kube = Kube(new_api_client())  # a fresh discovery each try
            missing = [f"{kind} ({version})" for version, kind in kinds
                       if not kube.serves(version, kind)]  # fmt: skip
        except (ApiException, OSError, urllib3.exceptions.HTTPError) as e:
            missing = [f"discovery: {clip(str(e))}"]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"after {timeout:.0f} s the API server does not serve {missing}")
        log.warning("waiting for the API server to serve %s", ", ".join(missing))
        time.sleep(2)  # a retry's pause, not a test's wait


class Kube:
    def __init__(self, api: client.ApiClient, field_manager: str = FIELD_MANAGER):
        self.field_manager = field_manager
        self.dynamic = dynamic.DynamicClient(api)
        # Discovery is cached here, under a lock: the client's own cache is not thread-safe
        # and the handlers run in a thread pool.
        self._resources: dict[tuple[str, str], Any] = {}
        self._unserved: dict[tuple[str, str], float] = {}  # kind -> when found missing
        self._discovery = threading.Lock()

    def resource(self, api_version: str, kind: str) -> Any:
        """The REST resource of a kind; ResourceNotFoundError when the API server serves
        no such kind (a CRD not installed, e.g. KEDA's)."""
        key = (api_version, kind)
        with self._discovery:
            if key in self._resources:
                return self._resources[key]
            missing_since = self._unserved.get(key)
            if (
                missing_since is not None
                and time.monotonic() - missing_since < UNSERVED_RETRY_SECONDS
            ):
                raise ResourceNotFoundError(f"{kind} ({api_version}) is not served")
            try:
                found = self.dynamic.resources.get(api_version=api_version, kind=kind)
            except ResourceNotFoundError:
                self._unserved[key] = time.monotonic()
                raise
            self._resources[key] = found
            return found

    def serves(self, api_version: str, kind: str) -> bool:
        try:
            self.resource(api_version, kind)
        except ResourceNotFoundError:
            return False
        return True

    def _call(self, verb: str, resource: Any, **kwargs) -> dict:
        code = "error"  # no answer: refused, reset, timed out
        try:
            resp = getattr(self.dynamic, verb)(
                resource, serialize=False, _request_timeout=TIMEOUT, **kwargs
            )
            code = str(resp.status)
        except ApiException as e:
            code = str(e.status)
            raise
        finally:
            probes.API_REQUESTS.labels(verb, code).inc()
        return json.loads(resp.data)

    def apply(self, obj: dict, *, dry_run: bool = False) -> dict:
        """Server-side apply under the operator's field manager, forcing conflicts: fields
        the operator sets are the operator's, whoever edited them since. Only for an object
        the operator controls: ``obj`` carries the resourceVersion it was checked at, so a
        change since (a replacement included) fails with 409. A dry run only validates
        (admission included) and persists nothing."""
        return self._call(
            "server_side_apply",
            self.resource(obj["apiVersion"], obj["kind"]),
            body=obj,
            field_manager=self.field_manager,
            force_conflicts=True,
            dry_run="All" if dry_run else None,
        )

    def create(self, obj: dict, *, dry_run: bool = False) -> dict:
        """Create, never overwrite: an object of that name made since it was found absent
        fails with 409 AlreadyExists."""
        return self._call(
            "create",
            self.resource(obj["apiVersion"], obj["kind"]),
            body=obj,
            namespace=obj["metadata"]["namespace"],
            field_manager=self.field_manager,
            dry_run="All" if dry_run else None,
        )

    def replace(self, obj: dict) -> dict:
        """A full update (PUT) under the operator's field manager; ``obj`` carries the
        resourceVersion it was computed from, so a concurrent change fails with 409."""
        return self._call(
            "replace",
            self.resource(obj["apiVersion"], obj["kind"]),
            body=obj,
            field_manager=self.field_manager,
        )

    def read(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._call(
                "get", self.resource(api_version, kind), name=name, namespace=namespace
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        preconditions: dict,
        propagation: str | None = None,
    ) -> bool:
        """Delete if present and still as checked (``preconditions``: its uid and
        resourceVersion; 409 otherwise); whether something was deleted. ``propagation``:
        what becomes of its dependents (a Job's pods are orphaned unless "Background")."""
        body: dict = {"preconditions": preconditions}
        if propagation:
            body["propagationPolicy"] = propagation
        try:
            self._call(
                "delete",
                self.resource(api_version, kind),
                name=name,
                namespace=namespace,
                body=body,
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list:
        found = self._call(
            "get", self.resource(api_version, kind), namespace=namespace,
            label_selector=label_selector,
        )  # fmt: skip
        return found.get("items") or []

    def read_isvc(self, namespace: str, name: str) -> dict | None:
        return self.read(API_VERSION, KIND, namespace, name)

    def patch_isvc_status(self, namespace: str, name: str, status: dict) -> None:
        """A merge patch of the status subresource: fields not named are kept; a number
        JSON cannot carry is written as null, and logged as the bug it is."""
        status, bad = finite(status)
        if bad:
            log.error("status of %s/%s: not finite, written as null: %s", namespace, name, bad)
        self._call(
            "patch",
            self.resource(API_VERSION, KIND).status,
            body={"status": status},
            name=name,
            namespace=namespace,
            content_type=MERGE,
        )

    def pvc_exists(self, namespace: str, name: str) -> bool:
        return self.read("v1", "PersistentVolumeClaim", namespace, name) is not None

    def read_service_account(self, namespace: str, name: str) -> dict | None:
        return self.read("v1", "ServiceAccount", namespace, name)


def post_event(body: dict, type_: str, reason: str, message: str) -> None:
    """An Event on the object, through kopf's poster (batched, rate-limited)."""
    # Outside a running operator (unit tests) there is nothing to post through.
    with contextlib.suppress(LookupError):
        kopf.event(body, type=type_, reason=reason, message=clip(message))
