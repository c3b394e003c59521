"""What the activator may act for, kept from watches: the services whose Service the operator
routes to it now (the operator's EndpointSlice for them exists), and the ClusterIPs of the
operator's Services. Requests are checked against this table, never against the API server,
so a flood of made-up hosts costs the API server nothing.

The operator writes that EndpointSlice only for a service that may scale to zero and only
while it is at zero or has no Ready replica (children/service.py: routes_to_activator); it
deletes it when the Service points back at the pods. The watches cover the namespaces the
activator serves, so a slice elsewhere is never seen.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from batchpilot.operator.activator.hosts import Target
from batchpilot.operator.children.meta import MANAGED_BY
from batchpilot.operator.children.service import SLICE_MANAGED_BY, SLICE_SERVICE_NAME
from batchpilot.operator.crd.api import KIND

Key = tuple[str, str]  # (namespace, object name)


def routed_target(endpoint_slice) -> Target | None:
    """The service an EndpointSlice routes to the activator: the operator's slice, named by
    the kubernetes.io/service-name label and owned by the InferenceService of that name."""
    meta = endpoint_slice.metadata
    labels = meta.labels or {}
    name = labels.get(SLICE_SERVICE_NAME)
    if labels.get(SLICE_MANAGED_BY) != MANAGED_BY or not name:
        return None
    owners = meta.owner_references or []
    if not any(o.kind == KIND and o.name == name for o in owners):
        return None
    return meta.namespace, name


def cluster_ips(service) -> tuple[str, ...]:
    spec = service.spec
    ips = spec.cluster_ips or ([spec.cluster_ip] if spec.cluster_ip else [])
    return tuple(ip for ip in ips if ip and ip != "None")


class Index:
    """One watch's objects, reduced by ``extract`` (None: not kept), by (namespace, name).
    Written by the watch's thread, read by the event loop: the lock orders them."""

    def __init__(self, extract: Callable, lock: threading.Lock, changed: Callable[[], None]):
        self.extract, self._lock, self._changed = extract, lock, changed
        self.items: dict[Key, object] = {}
        self.synced = False

    def replace(self, objects: Iterable) -> None:
        items = {}
        for obj in objects:
            value = self.extract(obj)
            if value is not None:
                items[(obj.metadata.namespace, obj.metadata.name)] = value
        with self._lock:
            self.items, self.synced = items, True
            self._changed()

    def apply(self, event_type: str, obj) -> None:
        key = (obj.metadata.namespace, obj.metadata.name)
        value = None if event_type == "DELETED" else self.extract(obj)
        with self._lock:
            if value is None:
                self.items.pop(key, None)
            else:
                self.items[key] = value
            self._changed()


class RouteTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slices: list[Index] = []
        self._services: list[Index] = []
        self._routed: frozenset[Target] = frozenset()
        self._names: frozenset[str] = frozenset()
        self._by_ip: dict[str, Target] = {}

    def slice_index(self) -> Index:
        index = Index(routed_target, self._lock, self._rebuild)
        self._slices.append(index)
        return index

    def service_index(self) -> Index:
        index = Index(cluster_ips, self._lock, self._rebuild)
        self._services.append(index)
        return index

    @property
    def synced(self) -> bool:
        return all(index.synced for index in (*self._slices, *self._services))

    def is_routed(self, target: Target) -> bool:
        return target in self._routed

    def has_name(self, name: str) -> bool:
        """Is some routed service named so (in any served namespace)?"""
        return name in self._names

    def by_cluster_ip(self, ip: str) -> Target | None:
        """The routed service whose Service has this ClusterIP."""
        target = self._by_ip.get(ip)
        return target if target in self._routed else None

    def _rebuild(self) -> None:
        # Under the lock; the readers see either the old or the new frozen views.
        routed = frozenset(t for index in self._slices for t in index.items.values())
        self._by_ip = {ip: key for index in self._services
                       for key, ips in index.items.items() for ip in ips}  # fmt: skip
        self._names = frozenset(name for _, name in routed)
        self._routed = routed
