"""The kopf timer that runs the closed loop's turns (turn.py has the laws' side).

Each round, for one InferenceService with autoscaling or tuning enabled: read what is in
force from the Deployment, run ``ClosedLoop.run_once`` (scrape, decide, apply
max_num_seqs live), merge its decisions into the status, post its Events, count them in
the operator's metrics, and hand over to the ordinary reconcile. That reconcile puts the
decisions into the children: replicas into the Deployment, max_num_seqs into the
ConfigMap new pods read (no rollout), an fp8 KV cache into the pod template (a rollout
with maxUnavailable 0).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kubernetes import client
from prometheus_client import Gauge

from batchpilot import names
from batchpilot.operator import probes
from batchpilot.operator.adapters import AdapterSync, failures
from batchpilot.operator.children.engine_args import read_engine_settings
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.children.plan import effective_engine
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.crd.spec import InferenceServiceSpec, SpecError, parse_spec
from batchpilot.operator.kube import post_event
from batchpilot.operator.loop.admin_client import AdminClient
from batchpilot.operator.loop.idle import WAKE_ANNOTATION
from batchpilot.operator.loop.scrape import PodMetricsSource, ReplicaSource, UrlMetricsSource
from batchpilot.operator.loop.state import LoopState
from batchpilot.operator.loop.status_memory import StatusMemory, merge_patch, reconcile_inputs
from batchpilot.operator.loop.timestamps import maybe_timestamp
from batchpilot.operator.loop.tuner_state import EngineSettings
from batchpilot.operator.loop.turn import ClosedLoop, LoopOutcome

if TYPE_CHECKING:
    from batchpilot.operator.reconcile import Reconciler

log = logging.getLogger("batchpilot.operator.loop")
# Events that say the loop could not do its job (the others report what it decided).
WARNING_REASONS = frozenset({"LoopBlind", "TuningAbandoned", "PlantDegraded"})
# The turns' blocking calls run on threads of their own. On asyncio's default executor
# (min(32, cores + 4) threads: 6 on 2 cores) the full reconciles the turns ask for filled
# every thread at 1,000 services, and each turn's Deployment read queued behind them: the
# loop ran 1.2 rounds per service in 6 minutes (py-spy, operator-scale benchmark).
CALL_THREADS = 8  # the Deployment read and the status patch of a turn
RECONCILE_THREADS = 8  # the full reconciles the turns ask for
# Turns that scrape and decide at once; the others wait their turn, first come first
# served. Past what the process can do, every service's interval stretches alike (the
# wait is batchpilot_operator_loop_turn_wait_seconds), instead of all turns at once
# parsing on one busy event loop while their scrapes' timeouts run out.
TURN_SLOTS = 32
BEHIND_LOG_SECONDS = 60.0  # at most one "behind" warning a minute
TURN_WAIT = Gauge(
    "batchpilot_operator_loop_turn_wait_seconds",
    "Seconds the latest loop turn waited for a slot (TURN_SLOTS turns run at once): the "
    "stretch of each service's loop interval when the process is over its size",
    registry=probes.REGISTRY,
)


def adapters_wanted(spec: dict, status: dict) -> bool:
    """Are there adapters to load, or ones status still names to unload?"""
    return bool((spec or {}).get("adapters") or (status or {}).get("adapters"))


def loop_wanted(spec: dict) -> bool:
    """Does this spec (as stored) ask for a closed loop at all?"""
    return bool(
        (spec.get("autoscaling") or {}).get("enabled") or (spec.get("tuning") or {}).get("enabled")
    )


def loop_spec(spec: InferenceServiceSpec) -> InferenceServiceSpec:
    """The spec as the loop sees it: autoscaling is the loop's only in builtin mode (an HPA
    or KEDA owns the replica count otherwise)."""
    if spec.autoscaling.enabled and not spec.autoscaling.builtin:
        off = spec.autoscaling.model_copy(update={"enabled": False})
        return spec.model_copy(update={"autoscaling": off})
    return spec


def settings_in_force(deployment: dict, spec: InferenceServiceSpec, status: dict) -> EngineSettings:
    """What the Deployment records; what the reconcile will apply where it records none.
    The step budget is live only: the template carries the budget profiled at start-up."""
    recorded = read_engine_settings(deployment)
    planned = effective_engine(spec, LoopState.from_status(status))
    tuned_budget = spec.tuning.max_num_batched_tokens is not None
    loras = names.MAX_LORAS.crd_field
    tuned_loras = spec.tuning.max_loras is not None
    return EngineSettings(
        max_num_seqs=recorded.get(names.MAX_NUM_SEQS.crd_field, planned.max_num_seqs),
        kv_cache_dtype=recorded.get(names.KV_CACHE_DTYPE.crd_field, planned.kv_cache_dtype),
        max_num_batched_tokens=planned.max_num_batched_tokens if tuned_budget else None,
        max_loras=recorded.get(loras, planned.max_loras) if tuned_loras else None,
    )


def wake_requested_at(body: dict) -> float | None:
    """The activator's latest wake request on the object, if any (a bad value is none)."""
    return maybe_timestamp(
        ((body.get("metadata") or {}).get("annotations") or {}).get(WAKE_ANNOTATION)
    )


def already_running(was: LoopState, now: LoopState, replicas: int) -> bool:
    """Only the replica count moved, to what the Deployment already runs (a service's first
    decision, mostly): nothing for the turn to apply. The timer's check sees the new state
    in status and records it with one full reconcile; the turn asking for another raced
    it, and at 1,000 services the two took half the operator's API calls while services
    were being made."""
    return was != now and replace(was, replicas=now.replicas) == now and now.replicas == replicas


def count(namespace: str, name: str, outcome: LoopOutcome, replicas: int) -> None:
    probes.LOOP_ROUNDS.labels(namespace, name).inc()
    probes.LOOP_LAST_ROUND.labels(namespace, name).set_to_current_time()
    probes.LOOP_BLIND.labels(namespace, name).set(1 if outcome.blind else 0)
    if outcome.scrape_failures:
        probes.SCRAPE_FAILURES.labels(namespace, name).inc(len(outcome.scrape_failures))
    if outcome.apply_failures:
        probes.APPLY_FAILURES.labels(namespace, name).inc(len(outcome.apply_failures))
    d = outcome.tuning
    if d is not None and d.changes and d.kind is not None:
        probes.DECISIONS.labels(namespace, name, d.kind, d.action).inc()
    if outcome.capacity is not None:
        probes.REPLICA_CAPACITY.labels(namespace, name).set(outcome.capacity)
    if outcome.desired_replicas is not None:
        probes.DESIRED_REPLICAS.labels(namespace, name).set(outcome.desired_replicas)
        if outcome.desired_replicas != replicas:
            kind = "scale_up" if outcome.desired_replicas > replicas else "scale_down"
            probes.DECISIONS.labels(namespace, name, kind, "apply").inc()


class LoopTimer:
    """One ClosedLoop for all InferenceServices (it keeps their windows apart by name)."""

    def __init__(
        self, config: OperatorConfig, reconciler: Reconciler, loop: ClosedLoop | None = None
    ):
        self.config = config
        self.rec = reconciler
        self._loop = loop
        self._adapters: AdapterSync | None = None
        # A wake request runs a turn at once, beside the timer's: one turn at a time each.
        self._turns: dict[tuple[str, str], asyncio.Lock] = {}
        self._status = StatusMemory(config.status_interval)
        self._adapter_turns: dict[tuple[str, str], asyncio.Lock] = {}
        self._wakes: dict[tuple[str, str], float] = {}  # the last wake request seen
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="loop-call")
        self._reconciles = ThreadPoolExecutor(RECONCILE_THREADS, thread_name_prefix="loop-rec")
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._behind_logged = float("-inf")

    async def _call(self, fn: Callable[..., Any], *args: Any, pool=None) -> Any:
        """A turn's blocking API call (a read, a status patch) on the loop's threads, or on
        ``pool`` (the reconciles a turn asks for run apart from the turns' calls)."""
        return await asyncio.get_running_loop().run_in_executor(
            pool or self._calls, functools.partial(fn, *args)
        )

    def _turn_slots(self) -> asyncio.Semaphore:
        """TURN_SLOTS, on the event loop that turns (a test runs one per turn)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(TURN_SLOTS))
        return self._slots[1]

    def _waited(self, seconds: float, logger) -> None:
        """Count a turn's wait for a slot; say so when it stretches the loop's interval."""
        TURN_WAIT.set(seconds)
        now = time.monotonic()
        if seconds > self.config.loop_interval and now - self._behind_logged > BEHIND_LOG_SECONDS:
            self._behind_logged = now
            logger.warning(
                "loop behind: a turn waited %.0f s for one of %d slots, so each service's "
                "loop interval is about %.0f s instead of %.0f s; shard (--shard) or "
                "lengthen --loop-interval",
                seconds,
                TURN_SLOTS,
                self.config.loop_interval + seconds,
                self.config.loop_interval,
            )

    @property
    def loop(self) -> ClosedLoop:
        if self._loop is None:
            self._loop = ClosedLoop(self._source(), AdminClient())
        return self._loop

    @property
    def adapters(self) -> AdapterSync:
        if self._adapters is None:
            self._adapters = AdapterSync(self._source(), AdminClient())
        return self._adapters

    def _source(self) -> ReplicaSource:
        if self.config.metrics_urls:
            return UrlMetricsSource(self.config.metrics_urls, self.config.admin_urls)
        return PodMetricsSource(client.CoreV1Api(self.rec.kube.dynamic.client))

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted service's metric samples."""
        if self._loop is not None:
            self._loop.forget(namespace, name)
        self._turns.pop((namespace, name), None)
        self._status.forget((namespace, name))
        self._adapter_turns.pop((namespace, name), None)
        self._wakes.pop((namespace, name), None)

    def wake_is_new(self, body: dict, *, listed: bool) -> bool:
        """Whether the object carries a wake request this process has not seen (a turn for
        it now). One first seen in the operator's initial listing is only remembered: the
        timer's first turn reads it, and a restart does not run every woken service's turn
        at once. Later events (status patches) carry the same request: no turn."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        wake_at = wake_requested_at(body)
        if wake_at is None:
            return False
        seen, self._wakes[key] = self._wakes.get(key), wake_at
        return not listed and wake_at != seen

    async def sync_adapters(self, body: dict, logger=log) -> None:
        """One adapter turn: every Ready replica's adapters to the spec's; status.adapters,
        its Events, and a reconcile when a failure appears or clears (Degraded)."""
        meta = body["metadata"]
        ns, name = meta["namespace"], meta["name"]
        async with self._adapter_turns.setdefault((ns, name), asyncio.Lock()):
            try:
                spec = parse_spec(body.get("spec"))
            except SpecError:
                return  # the reconcile reports it as Degraded
            owner = Owner.from_body(body)
            if await self._call(self.rec.watched_deployment, owner) is None:
                return  # no replica of ours: nothing to load into
            status = body.get("status") or {}
            token = self.rec.admin_token(owner)
            outcome = await self.adapters.run_once(ns, name, spec, status, token)
            before = status.get("adapters") or []
            if outcome.adapters != (status.get("adapters") or None):
                patch = {"adapters": outcome.adapters}
                await self._call(self.rec.kube.patch_isvc_status, ns, name, patch)
            for reason, message in outcome.events:
                logger.info("%s: %s", reason, message)
                post_event(body, "Normal", reason, message)
            if failures(before) != failures(outcome.adapters or []):
                await self._call(
                    self.rec.reconcile_by_name, ns, name, logger, pool=self._reconciles
                )

    async def tick(self, body: dict, logger: logging.Logger | logging.LoggerAdapter = log) -> None:
        meta = body["metadata"]
        ns, name = meta["namespace"], meta["name"]
        async with self._turns.setdefault((ns, name), asyncio.Lock()):
            await self._turn(body, ns, name, logger)

    async def _turn(self, body: dict, ns: str, name: str, logger) -> None:
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return  # the reconcile reports it as Degraded
        if "observedGeneration" not in (body.get("status") or {}):
            # Never reconciled: no Deployment of ours yet, and reading it would be a GET
            # answered 404 every turn of every service not built yet (thousands while 1,000
            # services were made). The reconcile's first status write ends this.
            return
        kube = self.rec.kube
        owner = Owner.from_body(body)
        deployment = await self._call(self.rec.watched_deployment, owner)
        if deployment is None:
            return  # nothing of ours serves yet: the reconcile builds it (or reports why not)
        asked = time.monotonic()
        async with self._turn_slots():
            self._waited(time.monotonic() - asked, logger)
            status = self._status.current((ns, name), body.get("status") or {})
            replicas = (deployment.get("spec") or {}).get("replicas", 0)
            outcome = await self.loop.run_once(
                ns,
                name,
                loop_spec(spec),
                status,
                replicas,
                settings_in_force(deployment, spec, status),
                self.rec.admin_token(owner),
                wake_requested_at(body),
            )
        count(ns, name, outcome, replicas)
        now = time.time()
        patch = self._status.record(
            (ns, name), status, outcome.status_patch, bool(outcome.events), now
        )
        if patch:
            try:
                await self._call(kube.patch_isvc_status, ns, name, patch)
            except Exception:
                self._status.forget((ns, name))  # the next turn starts from what is written
                raise
        for reason, message in outcome.events:
            logger.info("%s: %s", reason, message)
            warning = reason.endswith("Failed") or reason in WARNING_REASONS
            post_event(body, "Warning" if warning else "Normal", reason, message)
        after = merge_patch(status, outcome.status_patch)
        was, now_in = reconcile_inputs(status, now), reconcile_inputs(after, now)
        if was[1:] != now_in[1:]:
            # A loop condition flips (LoopBlind, PlantDegraded): status needs the reconcile.
            await self._call(self.rec.reconcile_by_name, ns, name, logger, pool=self._reconciles)
        elif was != now_in and not already_running(was[0], now_in[0], replicas):
            # New settings or replicas for the children. The timer's check reconciles the
            # same decisions once it sees them in status: whichever runs second skips, as
            # the children already carry them (two full reconciles per decision before).
            resync = {**body, "status": after}
            await self._call(
                self.rec.resync_by_name, ns, name, resync, logger, pool=self._reconciles
            )
