"""The activator's Kubernetes side: ``resolve``, ``wake`` and ``endpoints`` against the API
server (in-cluster credentials, else $KUBECONFIG, as the operator's own: operator/kube.py).

The client library is synchronous; each call runs on a thread so that the activator's event
loop keeps serving while the API server answers.
"""

from __future__ import annotations

import asyncio
import time

from kubernetes import client

from batchpilot.operator.activator.proxy import is_ip
from batchpilot.operator.children.meta import MANAGED_SELECTOR, PORT, selector_string
from batchpilot.operator.crd.api import GROUP, PLURAL, VERSION
from batchpilot.operator.kube import TIMEOUT
from batchpilot.operator.loop.idle import WAKE_ANNOTATION
from batchpilot.operator.loop.scrape import ready_pod_urls
from batchpilot.operator.loop.timestamps import timestamp

# resolve() answers are kept this long: a burst of requests for one bare host name or
# ClusterIP costs one lookup. Unknown hosts are kept too, so that junk costs no more.
RESOLVE_CACHE_SECONDS = 30.0
RESOLVE_CACHE_ENTRIES = 1024


def at_zero(isvc: dict) -> bool:
    """Scaled to zero, or no replica Ready: a service whose traffic may come here."""
    spec, status = isvc.get("spec") or {}, isvc.get("status") or {}
    return spec.get("replicas") == 0 or not status.get("readyReplicas")


class KubeTargets:
    def __init__(self, api: client.ApiClient):
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self._resolved: dict[str, tuple[float, tuple[str, str] | None]] = {}

    async def resolve(self, host: str) -> tuple[str, str] | None:
        """A ClusterIP -> the Service that has it; a bare name -> the one InferenceService
        of that name (or, of several, the one at zero)."""
        now = time.monotonic()
        cached = self._resolved.get(host)
        if cached and now - cached[0] < RESOLVE_CACHE_SECONDS:
            return cached[1]
        lookup = self._by_cluster_ip if is_ip(host) else self._by_name
        target = await asyncio.to_thread(lookup, host)
        if len(self._resolved) >= RESOLVE_CACHE_ENTRIES:
            self._resolved.clear()
        self._resolved[host] = (now, target)
        return target

    async def wake(self, namespace: str, name: str) -> None:
        # Milliseconds, as status times: the operator wakes a service at zero for a request
        # newer than its last activity (idle.py).
        patch = {"metadata": {"annotations": {WAKE_ANNOTATION: timestamp(time.time())}}}
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object,
            GROUP, VERSION, namespace, PLURAL, name, patch,
            _request_timeout=TIMEOUT,
        )  # fmt: skip

    async def endpoints(self, namespace: str, name: str) -> list[str]:
        """Base URLs of the service's Ready, non-terminating pods on the serving port."""
        pods = await asyncio.to_thread(
            self.core.list_namespaced_pod,
            namespace,
            label_selector=selector_string(name),
            _request_timeout=TIMEOUT,
        )
        return ready_pod_urls(pods.items, PORT)

    def _by_cluster_ip(self, ip: str) -> tuple[str, str] | None:
        services = self.core.list_service_for_all_namespaces(
            label_selector=MANAGED_SELECTOR, _request_timeout=TIMEOUT
        )
        for svc in services.items:
            # The operator names an InferenceService's Service after it (children/service.py).
            if ip in (svc.spec.cluster_ips or [svc.spec.cluster_ip]):
                return svc.metadata.namespace, svc.metadata.name
        return None

    def _by_name(self, name: str) -> tuple[str, str] | None:
        found = self.custom.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, field_selector=f"metadata.name={name}",
            _request_timeout=TIMEOUT,
        )["items"]  # fmt: skip
        if len(found) > 1:
            found = [isvc for isvc in found if at_zero(isvc)]
        if len(found) != 1:
            return None
        return found[0]["metadata"]["namespace"], name
