"""The activator's Kubernetes side: ``resolve``, ``wake`` and ``endpoints`` against the API
server (in-cluster credentials, else $KUBECONFIG, as the operator's own: operator/kube.py).

``resolve`` answers from watches (routes.py): it acts only for a service routed to the
activator now, in a namespace it serves. A bare name resolves in the namespace of the pod
that sent the request, as cluster DNS resolves it for that pod; the pod is looked up by its
IP only when some routed service has that name, at most once per IP per cache period.

The client library is synchronous; each call runs on a thread so that the activator's event
loop keeps serving while the API server answers.
"""

from __future__ import annotations

import asyncio
import threading
import time

from kubernetes import client

from batchpilot.operator.activator.hosts import Target, is_bare_name, is_ip, parse_host
from batchpilot.operator.activator.informer import Informer
from batchpilot.operator.activator.routes import RouteTable
from batchpilot.operator.children.meta import MANAGED_BY, MANAGED_SELECTOR, PORT, selector_string
from batchpilot.operator.children.service import SLICE_MANAGED_BY
from batchpilot.operator.crd.api import GROUP, PLURAL, VERSION
from batchpilot.operator.kube import TIMEOUT
from batchpilot.operator.loop.idle import WAKE_ANNOTATION
from batchpilot.operator.loop.scrape import ready_pod_urls
from batchpilot.operator.loop.timestamps import timestamp

SLICE_SELECTOR = f"{SLICE_MANAGED_BY}={MANAGED_BY}"  # the operator's slices: routes.py
# A client pod's namespace is kept this long (pods keep their IP for life; a reused IP is
# seen again within this), and for this many IPs.
CLIENT_CACHE_SECONDS = 30.0
CLIENT_CACHE_ENTRIES = 4096


class NotSynced(Exception):
    """The watches have not listed yet: the activator cannot tell what it serves."""


class KubeTargets:
    def __init__(self, api: client.ApiClient, namespaces: list[str] | None = None,
                 cluster_domain: str = "cluster.local"):  # fmt: skip
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.discovery = client.DiscoveryV1Api(api)
        self.namespaces = sorted(set(namespaces or []))
        self.cluster_domain = cluster_domain
        self.routes = RouteTable()
        self._stop = threading.Event()
        self._clients: dict[str, tuple[float, str | None]] = {}
        self._informers = self._make_informers()

    def start(self) -> None:
        for informer in self._informers:
            informer.start()

    def stop(self) -> None:
        self._stop.set()

    def _make_informers(self) -> list[Informer]:
        if not self.namespaces:
            return [
                Informer("slices", self.discovery.list_endpoint_slice_for_all_namespaces,
                         self.routes.slice_index(), self._stop, label_selector=SLICE_SELECTOR),
                Informer("services", self.core.list_service_for_all_namespaces,
                         self.routes.service_index(), self._stop, label_selector=MANAGED_SELECTOR),
            ]  # fmt: skip
        informers = []
        for ns in self.namespaces:
            informers += [
                Informer(f"slices/{ns}", self.discovery.list_namespaced_endpoint_slice,
                         self.routes.slice_index(), self._stop, namespace=ns,
                         label_selector=SLICE_SELECTOR),
                Informer(f"services/{ns}", self.core.list_namespaced_service,
                         self.routes.service_index(), self._stop, namespace=ns,
                         label_selector=MANAGED_SELECTOR),
            ]  # fmt: skip
        return informers

    async def resolve(self, hostname: str, client_ip: str) -> Target | None:
        """The routed service a Host names, for a request from client_ip; else None."""
        if not self.routes.synced:
            raise NotSynced("the activator has not listed its routes yet")
        if is_ip(hostname):
            return self.routes.by_cluster_ip(hostname)
        target = parse_host(hostname, self.cluster_domain)
        if target is not None:
            return target if self.routes.is_routed(target) else None
        if not (is_bare_name(hostname) and self.routes.has_name(hostname)):
            return None
        namespace = await self._client_namespace(client_ip)
        target = (namespace or "", hostname)
        return target if self.routes.is_routed(target) else None

    async def wake(self, namespace: str, name: str) -> None:
        # Milliseconds, as status times: the operator wakes a service at zero for a request
        # newer than its last activity (idle.py). Only this annotation: the chart's
        # admission policy refuses the activator any other change.
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

    async def _client_namespace(self, ip: str) -> str | None:
        now = time.monotonic()
        cached = self._clients.get(ip)
        if cached and now - cached[0] < CLIENT_CACHE_SECONDS:
            return cached[1]
        namespace = await asyncio.to_thread(self._pod_namespace, ip) if is_ip(ip) else None
        if len(self._clients) >= CLIENT_CACHE_ENTRIES:
            self._clients.clear()
        self._clients[ip] = (now, namespace)
        return namespace

    def _pod_namespace(self, ip: str) -> str | None:
        """The namespace of the served namespaces' pod that has this IP (host-network pods
        share their node's IP: those are never taken)."""
        selector = f"status.podIP={ip}"
        if not self.namespaces:
            pods = self.core.list_pod_for_all_namespaces(field_selector=selector,
                                                         _request_timeout=TIMEOUT).items  # fmt: skip
        else:
            pods = [pod for ns in self.namespaces
                    for pod in self.core.list_namespaced_pod(ns, field_selector=selector,
                                                             _request_timeout=TIMEOUT).items]  # fmt: skip
        namespaces = {pod.metadata.namespace for pod in pods if not pod.spec.host_network}
        return namespaces.pop() if len(namespaces) == 1 else None
