"""What the reconciler remembers between calls so that it need not ask the API server: the
last good full reconcile of each service (a resync is skipped until one is due), and each
serving Deployment as its watch last showed it (the loop reads one every turn: from here,
as a Go controller's informer cache serves it)."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

from batchpilot.operator.loop.state import LoopState

Key = tuple[str, str]  # (namespace, name) of the InferenceService


def resource_version(body: dict) -> int:
    """resourceVersion as a number, to tell the later of two copies of one object. The API
    server's are etcd revisions, which only grow; 0 when absent or not a number."""
    version = (body.get("metadata") or {}).get("resourceVersion") or ""
    return int(version) if version.isdigit() else 0


@dataclass(frozen=True)
class _Synced:
    generation: int
    loops: LoopState
    at: float  # monotonic
    uid: str = ""  # the object's: one deleted and made again under its name is another
    # A later loop state found to build the very children this reconcile applied.
    same: LoopState | None = None


class Resyncs:
    """When each service's last full reconcile found nothing wrong, and what from."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._synced: dict[Key, _Synced] = {}

    def good(self, key: Key, generation: int, loops: LoopState, uid: str = "") -> None:
        self._synced[key] = _Synced(generation, loops, self.clock(), uid)

    def forget(self, key: Key) -> None:
        self._synced.pop(key, None)

    def in_sync(self, key: Key, generation: int, loops: LoopState) -> bool:
        """Nothing a full reconcile reads can have changed, and none is due yet."""
        synced = self._synced.get(key)
        return self.current(key, generation) and loops in (synced.loops, synced.same)

    def current(self, key: Key, generation: int, uid: str | None = None) -> bool:
        """The last full reconcile found nothing wrong, was of this generation (and of
        this object, given its uid), and another is not due yet (whatever the loop decided
        since)."""
        synced = self._synced.get(key)
        return (
            synced is not None
            and synced.generation == generation
            and uid in (None, synced.uid)
            and self.clock() - synced.at < self.period(key)
        )

    def same_children(self, key: Key, loops: LoopState) -> None:
        """loops builds the children the last good reconcile applied: in sync as it was."""
        if (synced := self._synced.get(key)) is not None:
            self._synced[key] = replace(synced, same=loops)

    def period(self, key: Key) -> float:
        """The interval stretched by up to a tenth by a hash of the name: services made
        together do not resync together."""
        spread = zlib.crc32("/".join(key).encode()) % 1000 / 10_000
        return self.interval * (1 + spread)


class Deployments:
    """Each service's serving Deployment, the latest copy seen (watch event or apply)."""

    def __init__(self) -> None:
        self._latest: dict[Key, dict] = {}

    def get(self, key: Key) -> dict | None:
        return self._latest.get(key)

    def seen(self, key: Key, event_type: str | None, dep: dict) -> None:
        if dep["metadata"]["name"] != key[1]:
            return  # not the serving Deployment (every one of ours has its service's name)
        if event_type == "DELETED":
            self._latest.pop(key, None)
            return
        known = self._latest.get(key) or {}
        # A watch event older than what an apply returned is not kept over it.
        if resource_version(dep) >= resource_version(known):
            self._latest[key] = dep

    def forget(self, key: Key) -> None:
        self._latest.pop(key, None)
