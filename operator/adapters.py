"""LoRA adapters (spec.adapters): each Ready replica's loaded set kept equal to the spec's,
live, through the replica's admin API (load_lora_adapter / unload_lora_adapter).

The pod template never lists the adapters (no --lora-modules), so adding or removing one
rolls nothing: a new replica starts with the list the service's ConfigMap held when it was
made (children/config_map.py's LORA_MODULES_KEY), and every Ready replica is brought to the spec's list
here, the turn that first sees it included. What each replica holds is read from its /v1/models where it can be (an
--api-key hides it); otherwise every spec adapter is loaded again each turn (loading is
idempotent: "already loaded" counts as loaded) and every adapter status still names is
unloaded (404, not loaded, counts as unloaded). status.adapters is the memory between turns
and restarts: each adapter's path and state per replica.

Pure parts first (what to do on one replica, what status says after), then the I/O shell
``AdapterSync``, which loop/timer.py runs on the kopf adapter timer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from batchpilot.operator.bounds import clip
from batchpilot.operator.children.plan import plan_adapters
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.crd.status import MAX_ADAPTER_REPLICAS_SHOWN
from batchpilot.operator.loop.admin_client import AdapterRefused, AdminClient, AdminError
from batchpilot.operator.loop.scrape import Replica, ReplicaSource
from batchpilot.operator.loop.timestamps import parse_timestamp, timestamp

# A replica that refused an adapter (a corrupt or mismatched one) is asked again only after
# this: the files may be fixed in place, but asking every turn only fills the server's log.
RETRY_FAILED_SECONDS = 300.0
LOADED, LOADING, FAILED, UNLOADING = "Loaded", "Loading", "Failed", "Unloading"


@dataclass(frozen=True)
class Seen:
    """What status remembers of an adapter on one replica."""

    state: str
    message: str = ""
    time: float = 0.0


@dataclass(frozen=True)
class Memory:
    """status.adapters, parsed: adapter -> (path sent, pod -> Seen)."""

    paths: dict[str, str] = field(default_factory=dict)
    seen: dict[str, dict[str, Seen]] = field(default_factory=dict)

    @classmethod
    def from_status(cls, status: dict | None) -> Memory:
        paths: dict[str, str] = {}
        seen: dict[str, dict[str, Seen]] = {}
        for entry in (status or {}).get("adapters") or []:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                continue  # hand-edited: forgotten, never a crash
            paths[entry["name"]] = str(entry.get("path", ""))
            seen[entry["name"]] = {
                str(r["pod"]): Seen(str(r["state"]), str(r.get("message", "")), _time(r))
                for r in entry.get("replicas") or []
                if isinstance(r, dict) and "pod" in r and "state" in r
            }
        return cls(paths, seen)


def _time(entry: dict) -> float:
    try:
        return parse_timestamp(entry["time"])
    except (KeyError, TypeError, ValueError):
        return 0.0


@dataclass(frozen=True)
class Plan:
    """One replica's turn: unloads first (they free slots and memory), then loads."""

    unload: tuple[str, ...] = ()
    load: tuple[tuple[str, str], ...] = ()  # (name, path)
    held: dict[str, Seen] = field(default_factory=dict)  # Failed, not retried yet


def plan_replica(
    desired: dict[str, str],
    loaded: dict[str, str] | None,
    memory: Memory,
    pod: str,
    now: float,
) -> Plan:
    """What to do on one replica. ``loaded``: what it lists (name -> path; an empty path
    is unknown), None when it cannot be listed."""
    known = loaded if loaded is not None else {n: memory.paths.get(n, "") for n in memory.paths}
    unload = [n for n in known if n not in desired]
    load, held = [], {}
    for name, path in desired.items():
        seen = memory.seen.get(name, {}).get(pod)
        same_source = memory.paths.get(name) == path
        if seen and seen.state == FAILED and same_source and now - seen.time < RETRY_FAILED_SECONDS:
            held[name] = seen
            continue
        was = known.get(name)
        if was and was != path:
            unload.append(name)  # the source changed: load it again from the new path
        if loaded is None or name not in loaded or (was and was != path):
            load.append((name, path))
    return Plan(tuple(sorted(unload)), tuple(load), held)


@dataclass
class ReplicaResult:
    """After a replica's turn: adapter -> Seen (an unloaded one is absent)."""

    states: dict[str, Seen] = field(default_factory=dict)


def settle(plan: Plan, desired: dict[str, str], now: float) -> ReplicaResult:
    """The states a replica is in when every action of ``plan`` succeeds: the starting
    point the shell overwrites with each failure."""
    states = dict(plan.held)
    for name in desired:
        states.setdefault(name, Seen(LOADED, "", now))
    return ReplicaResult(states)


# --------------------------------------------------------------------------- status


def _replica_entries(states: dict[str, Seen]) -> list[dict]:
    order = {FAILED: 0, UNLOADING: 1, LOADING: 2, LOADED: 3}
    ranked = sorted(states.items(), key=lambda kv: (order.get(kv[1].state, 9), kv[0]))
    out = []
    for pod, seen in ranked[:MAX_ADAPTER_REPLICAS_SHOWN]:
        entry = {"pod": pod, "state": seen.state, "time": timestamp(seen.time)}
        if seen.message:
            entry["message"] = seen.message
        out.append(entry)
    return out


def adapters_status(
    desired: dict[str, str], memory: Memory, results: dict[str, ReplicaResult]
) -> list[dict]:
    """status.adapters: the spec's adapters in order, then removed ones still loaded
    somewhere (Unloading)."""
    removed = [n for n in memory.paths if n not in desired]
    out = []
    for name in [*desired, *removed]:
        states = {pod: r.states[name] for pod, r in results.items() if name in r.states}
        if name not in desired and not states:
            continue  # unloaded everywhere: forgotten
        out.append(
            {
                "name": name,
                "path": desired.get(name, memory.paths.get(name, "")),
                "loaded": sum(s.state == LOADED for s in states.values()),
                "replicas": _replica_entries(states),
            }
        )
    return out


def failures(adapters: list[dict]) -> dict[tuple[str, str], str]:
    """(adapter, pod) -> message of each Failed replica."""
    return {
        (a["name"], r["pod"]): r.get("message", "")
        for a in adapters
        for r in a.get("replicas") or []
        if r.get("state") == FAILED
    }


def _served_by_all(entry: dict | None) -> bool:
    return entry is not None and 0 < entry.get("loaded", 0) == len(entry.get("replicas") or [])


def events(before: list[dict], after: list[dict]) -> list[tuple[str, str]]:
    """(reason, message): an adapter now served by every replica, one unloaded from all.
    A failure is the Degraded condition's (AdapterFailed), with its own Event."""
    was = {a.get("name"): a for a in before if isinstance(a, dict)}
    out = [
        ("AdapterLoaded", f"adapter {a['name']} loaded on {a['loaded']} replica(s)")
        for a in after
        if _served_by_all(a) and not _served_by_all(was.get(a["name"]))
    ]
    for name in sorted(set(was) - {a["name"] for a in after}, key=str):
        out.append(("AdapterUnloaded", f"adapter {name} unloaded from every replica"))
    return out


# --------------------------------------------------------------------------- the shell


@dataclass
class AdapterOutcome:
    adapters: list[dict] | None  # None: remove status.adapters (no adapter, none left)
    events: list[tuple[str, str]]


class AdapterSync:
    def __init__(
        self,
        source: ReplicaSource,
        admin: AdminClient,
        clock: Callable[[], float] = time.time,
    ):
        self.source = source
        self.admin = admin
        self.clock = clock

    async def run_once(
        self, namespace: str, name: str, spec: InferenceServiceSpec, status: dict, token: str
    ) -> AdapterOutcome:
        desired = {p.name: p.path for p in plan_adapters(spec)}
        memory = Memory.from_status(status)
        replicas = await self.source.replicas(namespace, name)
        now = self.clock()
        answers = await asyncio.gather(
            *(self._replica(r, desired, memory, token, now) for r in replicas)
        )
        results = {r.name: a for r, a in zip(replicas, answers, strict=True)}
        after = adapters_status(desired, memory, results)
        before = status.get("adapters") or []
        return AdapterOutcome(after or None, events(before, after))

    async def _replica(
        self, replica: Replica, desired: dict[str, str], memory: Memory, token: str, now: float
    ) -> ReplicaResult:
        loaded = await self.admin.list_adapters(replica.admin_url, token)
        plan = plan_replica(desired, loaded, memory, replica.name, now)
        result = settle(plan, desired, now)
        for adapter in plan.unload:
            try:
                await self.admin.unload_adapter(replica.admin_url, token, adapter)
            except AdminError as e:
                # In flight (400) or unreachable: still loaded, asked again next turn.
                result.states[adapter] = Seen(UNLOADING, _why(e), now)
        for adapter, path in plan.load:
            if result.states[adapter].state == UNLOADING:
                # The old source is still loaded: a load now would count as done.
                result.states[adapter] = Seen(LOADING, "waiting for the old source to unload", now)
                continue
            try:
                await self.admin.load_adapter(replica.admin_url, token, adapter, path)
            except AdapterRefused as e:
                result.states[adapter] = Seen(FAILED, e.message, now)
            except AdminError as e:
                result.states[adapter] = Seen(LOADING, _why(e), now)
        return result


def _why(e: AdminError) -> str:
    return clip(e.message if isinstance(e, AdapterRefused) else str(e))
