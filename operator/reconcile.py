"""The reconcile: one idempotent function, ``Reconciler.reconcile``, does all the work for
an InferenceService: validate the spec, wait for its model cache's fill (model_cache.py),
build the children (children/), check that every existing object of their names is its
own (ownership.py), create or server-side apply them under one field manager, and write
the status (status.py). The kopf handlers (handlers.py)
run it on create, update and resume, when a child is deleted or edited by hand (watch
events), and on a timer (``resync_by_name``: drift correction every ``resync_interval``).
A Deployment's status changes refresh the owner's status only.
"""

from __future__ import annotations

import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import kopf

from batchpilot.operator import drift, ownership, stale, status
from batchpilot.operator.api_errors import permanent_problem
from batchpilot.operator.children.build import build_children
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.children.picker import picker_name
from batchpilot.operator.children.plan import desired_replicas
from batchpilot.operator.children.secret import admin_token
from batchpilot.operator.children.service import (
    ENDPOINT_SLICE_KIND,
    SLICE_SERVICE_NAME,
    Activator,
    activator_of,
    may_route_to_activator,
    routes_to_activator,
    service_url,
)
from batchpilot.operator.coalesce import Coalescer
from batchpilot.operator.config import FIELD_MANAGER, OperatorConfig
from batchpilot.operator.crd.spec import InferenceServiceSpec, SpecError, parse_spec
from batchpilot.operator.kube import ApiException, Kube, new_api_client, post_event
from batchpilot.operator.loop.state import LoopState
from batchpilot.operator.model_cache import ensure_cache
from batchpilot.operator.ownership import controller_owner
from batchpilot.operator.refresh import READY_DELAY, StatusRefresh
from batchpilot.operator.remembered import Deployments, Resyncs
from batchpilot.operator.spec_checks import check_spec
from batchpilot.operator.status import CacheState, Problem

log = logging.getLogger("batchpilot.operator")
READ_THREADS = 16  # the children's reads and writes of the builds in flight (kopf runs 16)
# The status refreshes in flight, as many as kopf's handlers that ran them before: with 4, at
# 1,000 services the refreshes queued (all Ready 173 s after the last apply, 54 s before).
REFRESH_THREADS = 16


def _key(child: dict) -> tuple[str, str]:
    return child["kind"], child["metadata"]["name"]


def about(body: dict, logger):
    """A kopf logger bound to this InferenceService, whatever triggered the reconcile (a
    child's watch event, a loop turn): its lines name the object they are about. Events
    are posted explicitly (post_event), so this one posts none."""
    settings = (getattr(logger, "extra", None) or {}).get("settings")
    if not isinstance(logger, kopf.ObjectLogger) or settings is None:
        return logger
    return kopf.LocalObjectLogger(body=body, settings=settings)


class Reconciler(StatusRefresh):
    def __init__(self, config: OperatorConfig, kube: Kube | None = None,
                 refresh_delay: float = READY_DELAY):  # fmt: skip
        self.config = config
        self._kube = kube
        if config.admin_key is None:
            log.warning(
                "no admin key (BATCHPILOT_ADMIN_KEY): a random one for this process, so the "
                "admin tokens change, and the pods roll, at every operator restart"
            )
        key = config.admin_key.get_secret_value() if config.admin_key else None
        self._admin_key = key.encode() if key else secrets.token_bytes(32)
        self._locks: dict[tuple[str, str], threading.RLock] = {}
        self._locks_guard = threading.Lock()
        # What the last apply wrote, per (namespace, kind, name) of each child: a watch event
        # that does not match it means someone else changed the child. For Deployments the
        # generation is compared (the server normalizes pod templates).
        self._desired: dict[tuple[str, str, str], dict] = {}
        self._applied_generation: dict[tuple[str, str], int] = {}
        # Services that may go to zero, and whether their Service routes to the activator
        # now: a Deployment event that crosses "no replica Ready" switches it.
        self._to_activator: dict[tuple[str, str], bool] = {}
        self._resyncs = Resyncs(config.resync_interval)
        # A build's ownership checks read its children at once, not one after another: at
        # 1,000 services a first build waited on a loaded API server for each in turn.
        self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="child-read")
        self._deployments = Deployments()
        # A Deployment's events refresh status (refresh.py): 0 refreshes at once (tests).
        self._refreshes = Coalescer(
            refresh_delay, self._refresh_later, REFRESH_THREADS, name="status-refresh"
        )
        self._ready_shown: dict[tuple[str, str], bool] = {}

    @property
    def kube(self) -> Kube:
        if self._kube is None:
            self._kube = Kube(new_api_client(), FIELD_MANAGER)
        return self._kube

    def _lock(self, namespace: str, name: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.RLock())

    # ------------------------------------------------------------------ the reconcile

    def reconcile(self, body: dict, logger: logging.Logger | logging.LoggerAdapter = log) -> None:
        meta = body["metadata"]
        self.reconcile_by_name(meta["namespace"], meta["name"], logger)

    def reconcile_by_name(self, namespace: str, name: str, logger=log) -> None:
        """Reconcile the object as it is now. Calls for one object are serialized, and each
        reads the object afresh inside the lock: the status it starts from is the one the
        previous call wrote, whatever the trigger's copy said."""
        with self._lock(namespace, name):
            body = self.kube.read_isvc(namespace, name)
            if body is None:
                self._forget(namespace, name)
                return
            if body["metadata"].get("deletionTimestamp"):
                return  # owner references and the garbage collector remove the children
            self._reconcile(body, about(body, logger))

    def create_by_name(self, body: dict, logger=log) -> None:
        """kopf's creation cause. Kopf waits consistency_timeout (5 s) for its own patch
        to come back on the watch, then takes an older event for the latest: one without
        its last-handled annotation, so a creation again. Behind a loaded API server the
        patch came 50 to 70 s late, and 116 of 1,000 services were created twice (13
        requests each). A creation of the object, at the generation, that this process
        reconciled and found good is that replay: nothing to do."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if self._resyncs.current(key, meta.get("generation", 1), meta.get("uid", "")):
            about(body, logger).info("Creation replayed from an old watch event: in sync")
            return
        self.reconcile_by_name(*key, logger)

    def resync_by_name(self, namespace: str, name: str, body: dict, logger=log) -> None:
        """The timer's check: a full reconcile unless the last one found nothing wrong, was
        of this generation and loop state (or of one that builds the same children), and
        is not resync_interval old yet. Edits, and drift in the watched children, are
        reconciled at once on their watch events."""
        key = (namespace, name)
        generation = body["metadata"].get("generation", 1)
        loops = LoopState.from_status(body.get("status"))
        # A Service at the activator follows the activator's pods, which nothing watches.
        if key in self._to_activator or not (
            self._resyncs.in_sync(key, generation, loops) or self._builds_as_applied(body, loops)
        ):
            self.reconcile_by_name(namespace, name, logger)

    def _builds_as_applied(self, body: dict, loops: LoopState) -> bool:
        """Only the loop's state moved since the last good reconcile, which is not due yet,
        and the children built from it are exactly what that reconcile applied: a decision
        the Deployment already runs (the first turn's, at every service) needs no full
        reconcile, which re-reads and re-applies every child (13 requests)."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if not self._resyncs.current(key, meta.get("generation", 1)):
            return False
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return False
        children = self._children(Owner.from_body(body), spec, loops, None)
        if any(self._desired.get((key[0], *_key(c))) != c for c in children):
            return False
        self._resyncs.same_children(key, loops)  # remembered: not built again
        return True

    def _forget(self, namespace: str, name: str) -> None:
        """Drop what is remembered about a deleted InferenceService's children."""
        self._resyncs.forget((namespace, name))
        self._deployments.forget((namespace, name))
        self._applied_generation.pop((namespace, name), None)
        self._to_activator.pop((namespace, name), None)
        self._ready_shown.pop((namespace, name), None)
        for key in [k for k in self._desired if k[0] == namespace]:
            if controller_owner(self._desired[key]) == (namespace, name):
                del self._desired[key]

    def _reconcile(self, body: dict, logger) -> None:
        meta = body["metadata"]
        ns, name, generation = meta["namespace"], meta["name"], meta.get("generation", 1)
        prev = body.get("status") or {}
        self._resyncs.forget((ns, name))
        url = deployment = cache = None
        spec, problem = check_spec(self.kube, body, ns)
        if spec is not None and problem is None:
            cache, problem = self._cache(Owner.from_body(body), spec)
        # Until the model cache is filled no pod is started: none made, none rolled.
        waiting = cache is not None and not cache.ready
        if spec is not None and problem is None and not waiting:
            deployment, problem = self._build(Owner.from_body(body), spec, prev, logger)
            url = service_url(name, ns, self.config.cluster_domain)
        if problem is not None or waiting:
            deployment = self.owned_deployment(Owner.from_body(body))
            url = prev.get("url") if deployment is not None else None
        new = status.compute_status(
            name=name,
            generation=generation,
            prev=prev,
            deployment=deployment,
            problem=problem,
            url=url,
            to_activator=self._to_activator.get((ns, name), False),
            cache=cache,
            picker_failed=status.picker_failure(self._picker(Owner.from_body(body), spec)),
        )
        self._write_status(body, prev, new, problem is None and not waiting, logger)
        if problem is None and not waiting:
            loops = LoopState.from_status(prev)
            self._resyncs.good((ns, name), generation, loops, meta.get("uid", ""))

    def _cache(
        self, owner: Owner, spec: InferenceServiceSpec
    ) -> tuple[CacheState | None, Problem | None]:
        try:
            return ensure_cache(self.kube, owner, spec, spec.image or self.config.server_image)
        except ApiException as e:
            if (problem := permanent_problem(e)) is None:
                raise  # transient: kopf retries with backoff
            return None, problem

    def _build(
        self, owner: Owner, spec: InferenceServiceSpec, prev: dict, logger
    ) -> tuple[dict | None, Problem | None]:
        """Write every child; (the live Deployment, None), or (None, the problem) when an
        object of a child's name is someone else's or the API server refuses them for good."""
        activator = self._activator_route(owner, spec, prev)
        children = self._children(owner, spec, LoopState.from_status(prev), activator)
        (secret,) = [c for c in children if c["kind"] == "Secret"]
        others = [c for c in children if c["kind"] != "Secret"]
        try:
            # By kind and name: the endpoint picker's Deployment, Service and ConfigMap
            # stand beside the server's.
            found = dict(zip(map(_key, others), self._reads.map(self._read, others), strict=True))
            conflicts = [
                why for c in others if (why := ownership.conflict(c["kind"], found[_key(c)], owner))
            ]
            if conflicts:
                return None, Problem(status.NAME_CONFLICT, ownership.conflicts_message(conflicts))
            # A dry run of the Deployment first: the API server validates the pass-through
            # fields (affinity, volumes, env) before any child exists, so a bad spec never
            # leaves half-built children.
            serving = ("Deployment", owner.name)
            (deployment,) = [c for c in others if _key(c) == serving]
            self._write(deployment, found[serving], owner, logger, dry_run=True)
            written = self._write_all(secret, others, found, owner, logger)
            if not stale.first_build(prev, found):
                stale.delete_stale(self.kube, owner, spec, to_activator=activator is not None)
                stale.delete_stale_picker(self.kube, owner, others)
        except ApiException as e:
            if (problem := permanent_problem(e)) is None:
                raise  # transient: kopf retries with backoff
            return None, problem
        for child in children:
            self._desired[(owner.namespace, child["kind"], child["metadata"]["name"])] = child
        if may_route_to_activator(spec) and self.config.activator_service:
            self._to_activator[(owner.namespace, owner.name)] = activator is not None
        else:
            self._to_activator.pop((owner.namespace, owner.name), None)
        live = written[serving]
        self._deployments.seen((owner.namespace, owner.name), None, live)
        self._applied_generation[(owner.namespace, owner.name)] = live["metadata"]["generation"]
        return live, None

    def _write_all(
        self, secret: dict, others: list[dict], found: dict, owner: Owner, logger
    ) -> dict[tuple[str, str], dict]:
        """The children written, by kind and name: what comes before the Deployment in
        apply order (the Secret and ConfigMap it reads, its Service and PDB) at once, one
        round trip instead of four; then the Deployment; then the rest in order."""
        at = next(i for i, c in enumerate(others) if _key(c) == ("Deployment", owner.name))
        first = [self._reads.submit(self._create_secret, secret)]
        first += [self._reads.submit(self._write, c, found[_key(c)], owner, logger)
                  for c in others[:at]]  # fmt: skip
        wait(first)
        written = {_key(c): f.result() for c, f in zip(others[:at], first[1:], strict=True)}
        first[0].result()
        for c in others[at:]:
            written[_key(c)] = self._write(c, found[_key(c)], owner, logger)
        return written

    def _children(
        self, owner: Owner, spec: InferenceServiceSpec, loops: LoopState, activator
    ) -> list[dict]:
        image = spec.image or self.config.server_image
        token = self.admin_token(owner)
        return build_children(
            owner, spec, image=image, admin_token=token, loops=loops, activator=activator
        )

    def _activator_route(
        self, owner: Owner, spec: InferenceServiceSpec, prev: dict
    ) -> Activator | None:
        """The activator, when the Service is to route there now; else None."""
        if not (self.config.activator_service and may_route_to_activator(spec)):
            return None
        dep = self.kube.read("apps/v1", "Deployment", owner.namespace, owner.name)
        ready = ((dep or {}).get("status") or {}).get("readyReplicas") or 0
        desired = desired_replicas(spec, LoopState.from_status(prev))
        ns, name = self.config.activator_service.split("/")
        slices = self.kube.list(*ENDPOINT_SLICE_KIND, ns, f"{SLICE_SERVICE_NAME}={name}")
        activator = activator_of(slices)
        return activator if routes_to_activator(spec, desired, ready, activator) else None

    def _apply_pinned(self, child: dict, found: dict, dry_run: bool) -> dict:
        pinned = {**child, "metadata": {**child["metadata"], **ownership.pin(found)}}
        return self.kube.apply(pinned, dry_run=dry_run)

    def _read(self, child: dict) -> dict | None:
        meta = child["metadata"]
        return self.kube.read(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])

    def _create_secret(self, secret: dict) -> None:
        """Create the token's Secret where it is missing. The operator may not read Secrets:
        one already there is taken to be this one, as no one else can know its name
        (children/secret.py's secret_name), and is never changed (its content is fixed by
        its name)."""
        try:
            self.kube.create(secret)
        except ApiException as e:
            if e.status != 409:
                raise

    def _picker(self, owner: Owner, spec: InferenceServiceSpec | None) -> dict | None:
        """The deployed endpoint picker's Deployment, when the spec asks for one and it is
        this service's."""
        epp = spec.routing.picker if spec is not None else None
        if epp is None:
            return None
        dep = self.kube.read("apps/v1", "Deployment", owner.namespace, picker_name(owner, epp))
        return dep if dep is not None and ownership.controlled_by(dep, owner) else None

    def _write(
        self, child: dict, found: dict | None, owner: Owner, logger, *, dry_run: bool = False
    ) -> dict:
        """Create a child that was not there, or apply over the one checked to be ours."""
        if found is None:
            return self.kube.create(child, dry_run=dry_run)
        try:
            live = self._apply_pinned(child, found, dry_run)
        except ApiException as e:
            # Changed since it was checked: most often a status update by its controller.
            # Check again and apply once more; replaced or gone, the next round decides.
            found = self._read(child) if e.status == 409 else None
            if found is None or not ownership.controlled_by(found, owner):
                raise
            live = self._apply_pinned(child, found, dry_run)
        if dry_run:
            return live
        others = drift.foreign_managers(live, self.kube.field_manager)
        if others:
            # Server-side apply forced our fields back but kept what others added: replace
            # the declared parts wholesale (a 409 on a concurrent change retries via kopf).
            logger.info(
                "%s %s: dropping changes by %s",
                child["kind"],
                child["metadata"]["name"],
                ", ".join(sorted(set(others))),
            )
            live = self.kube.replace(drift.restored(live, child))
        return live

    def admin_token(self, owner: Owner) -> str:
        """The service's admin token, derived from the operator's key (never read back)."""
        return admin_token(self._admin_key, owner)

    def owned_deployment(self, owner: Owner) -> dict | None:
        """The serving Deployment, if it is this InferenceService's (status and the loop
        never describe or call someone else's)."""
        dep = self.kube.read("apps/v1", "Deployment", owner.namespace, owner.name)
        return dep if dep is not None and ownership.controlled_by(dep, owner) else None

    def watched_deployment(self, owner: Owner) -> dict | None:
        """owned_deployment as its watch last showed it, without a request; read from the
        API server while the watch has shown none (a service made a moment ago)."""
        dep = self._deployments.get((owner.namespace, owner.name))
        if dep is None:
            return self.owned_deployment(owner)
        return dep if ownership.controlled_by(dep, owner) else None

    def _write_status(self, body: dict, prev: dict, new: dict, applied: bool, logger) -> None:
        meta = body["metadata"]
        if any(prev.get(k) != v for k, v in new.items()):
            self.kube.patch_isvc_status(meta["namespace"], meta["name"], new)
        self._shown(meta["namespace"], meta["name"], new)
        was = status.find_condition(prev, status.DEGRADED) or {}
        now = status.find_condition(new, status.DEGRADED) or {}
        if now.get("status") == "True" and (
            was.get("status") != "True" or was.get("message") != now.get("message")
        ):
            logger.warning("Degraded (%s): %s", now.get("reason"), now.get("message"))
            post_event(body, "Warning", now["reason"], now["message"])
        if applied and status.newly_applied(prev, new):
            engine = new.get("engine") or {}
            message = (
                f"generation {new['observedGeneration']}: image {new.get('image')}, "
                + ", ".join(f"{k}={v}" for k, v in sorted(engine.items()))
            )
            logger.info("Applied %s", message)
            post_event(body, "Normal", "Applied", message)

    # ------------------------------------------------------------------ child events

    def on_deployment_event(self, event_type: str | None, dep: dict, logger=log) -> None:
        owner = controller_owner(dep)
        if owner is None:
            return
        ns, name = owner
        if dep["metadata"]["name"] != name:  # the endpoint picker's
            self._on_picker_event(event_type, dep, logger)
            return
        self._deployments.seen(owner, event_type, dep)
        if event_type == "DELETED":
            logger.info("Deployment deleted by someone else: restoring it")
            self.reconcile_by_name(ns, name, logger)
            return
        with self._lock(ns, name):  # after any reconcile in flight has recorded its apply
            applied = self._applied_generation.get(owner)
            generation = dep["metadata"].get("generation", 0)
            if applied is not None and generation < applied:
                return  # a stale event: the one for our latest apply follows
            desired = self._desired.get((ns, "Deployment", dep["metadata"]["name"]))
            if (applied is not None and generation != applied) or (
                desired is not None and drift.drifted(desired, dep)
            ):
                logger.info("Deployment changed by someone else: restoring it")
                self.reconcile_by_name(ns, name, logger)
                return
            routed = self._to_activator.get(owner)
            none_ready = not (dep.get("status") or {}).get("readyReplicas")
            if routed is not None and routed != none_ready:
                # A first replica Ready (or the last one gone): the Service switches between
                # the replicas and the activator.
                self.reconcile_by_name(ns, name, logger)
                return
            self._request_refresh(owner, dep)

    def _on_picker_event(self, event_type: str | None, dep: dict, logger) -> None:
        """The endpoint picker's Deployment: restored like any other child, and its
        conditions refresh Degraded."""
        ns, name = controller_owner(dep) or ("", "")
        self.on_child_event(event_type, dep, logger)
        if event_type != "DELETED":
            with self._lock(ns, name):
                self._refresh_status(ns, name, dep, picker=True)

    def on_child_event(self, event_type: str | None, child: dict, logger=log) -> None:
        owner = controller_owner(child)
        if owner is None or event_type not in ("DELETED", "MODIFIED"):
            return
        meta = child["metadata"]
        desired = self._desired.get((meta["namespace"], child["kind"], meta["name"]))
        if event_type == "DELETED" or desired is None or drift.drifted(desired, child):
            logger.info(
                "%s %s by someone else: restoring it",
                child["kind"],
                "deleted" if event_type == "DELETED" else "changed",
            )
            self.reconcile_by_name(*owner, logger)
