"""Pure status computation: the InferenceService's status from its serving Deployment and
from what the operator found wrong with the spec.

Conditions follow Kubernetes conventions (metav1.Condition): type, status, reason, message,
lastTransitionTime (kept while the status does not change) and observedGeneration.

- Ready: enough replicas are ready to serve (True even mid-rollout: maxUnavailable is 0).
- Progressing: a rollout is under way (False with RolloutComplete once it is done).
- Degraded: the spec cannot be applied as is (InvalidSpec, ModelSourceNotFound, ...), the
  Deployment reports ReplicaFailure or ProgressDeadlineExceeded, or a replica refused a LoRA
  adapter (AdapterFailed, from status.adapters), or the endpoint picker the operator runs
  cannot (EndpointPickerUnavailable: its Deployment's ReplicaFailure or
  ProgressDeadlineExceeded, e.g. an image that does not pull).
- ModelCacheReady (with spec.model.cache only): the fill Job has succeeded (Filled), runs
  (Filling: no new pods until it is done) or has failed (Failed, also Degraded).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

from batchpilot.operator.bounds import clip
from batchpilot.operator.children.engine_args import read_engine_settings
from batchpilot.operator.children.meta import selector_string
from batchpilot.operator.children.pod import CONTAINER

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
LOOP_BLIND = "LoopBlind"
PLANT_DEGRADED = "PlantDegraded"
MODEL_CACHE_READY = "ModelCacheReady"
# ModelCacheReady's reasons; Ready and Progressing say MODEL_CACHE_FILLING while it fills.
CACHE_FILLED = "Filled"
CACHE_FILLING = "Filling"
CACHE_FAILED = "Failed"
MODEL_CACHE_FILLING = "ModelCacheFilling"

# Problems the operator finds with the spec or with applying it. A status refresh from a Deployment event keeps
# them for the generation they were found in; the next full reconcile re-evaluates them.
INVALID_SPEC = "InvalidSpec"
MODEL_SOURCE_NOT_FOUND = "ModelSourceNotFound"
SERVICE_ACCOUNT_NOT_FOUND = "ServiceAccountNotFound"
SERVICE_ACCOUNT_NOT_ALLOWED = "ServiceAccountNotAllowed"  # not labelled for InferenceServices
# An object of a child's name exists and is not this InferenceService's: left untouched.
NAME_CONFLICT = "NameConflict"
APPLY_FAILED = "ApplyFailed"  # the API server refused the children (RBAC, a bad request)
AUTOSCALER_NOT_SERVED = "AutoscalerNotServed"  # mode keda without KEDA's CRDs
INFERENCE_POOL_NOT_SERVED = "InferencePoolNotServed"  # routing.inferencePool without GIE's CRDs
ADAPTER_SOURCE_NOT_FOUND = "AdapterSourceNotFound"  # an adapter's pvc:// claim is missing
MODEL_CACHE_FAILED = "ModelCacheFailed"  # the fill Job failed: retried when it is deleted
# A replica refused an adapter (status.adapters says which and why): not a spec problem,
# the adapter sync retries it.
ADAPTER_FAILED = "AdapterFailed"
MAX_ADAPTER_FAILURES_NAMED = 5
# The deployed endpoint picker's Deployment cannot run: not a spec problem either, its
# Deployment's own conditions say so and clear.
PICKER_UNAVAILABLE = "EndpointPickerUnavailable"
SPEC_REASONS = frozenset(
    [
        INVALID_SPEC,
        MODEL_SOURCE_NOT_FOUND,
        SERVICE_ACCOUNT_NOT_FOUND,
        SERVICE_ACCOUNT_NOT_ALLOWED,
        NAME_CONFLICT,
        APPLY_FAILED,
        AUTOSCALER_NOT_SERVED,
        INFERENCE_POOL_NOT_SERVED,
        ADAPTER_SOURCE_NOT_FOUND,
        MODEL_CACHE_FAILED,
    ]
)


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


@dataclass(frozen=True)
class CacheState:
    """The model cache as its fill Job shows it: ModelCacheReady's status, reason and
    message."""

    ready: bool
    reason: str  # CACHE_FILLED, CACHE_FILLING or CACHE_FAILED
    message: str


def kept_cache(prev: dict | None) -> CacheState | None:
    """The cache state the last reconcile recorded (a status refresh reads no Job)."""
    c = find_condition(prev, MODEL_CACHE_READY)
    if c is None:
        return None
    return CacheState(c.get("status") == "True", c.get("reason", ""), c.get("message", ""))


def newly_applied(prev: dict | None, new: dict) -> bool:
    """A generation's children written for the first time: a new generation, or the one
    that waited for its model cache."""
    was = find_condition(prev, PROGRESSING) or {}
    return (prev or {}).get("observedGeneration") != new["observedGeneration"] or (
        was.get("reason") == MODEL_CACHE_FILLING
    )


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(status: dict | None, type_: str) -> dict | None:
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def kept_problem(prev: dict | None, generation: int) -> Problem | None:
    """The spec problem recorded for this generation, if any."""
    c = find_condition(prev, DEGRADED)
    if (
        c
        and c.get("status") == "True"
        and c.get("reason") in SPEC_REASONS
        and c.get("observedGeneration") == generation
    ):
        return Problem(c["reason"], c.get("message", ""))
    return None


@dataclass(frozen=True)
class DeploymentView:
    desired: int
    observed: bool
    replicas: int
    updated: int
    ready: int
    available: int
    deadline_exceeded: str | None  # the Deployment's message when true
    replica_failure: str | None
    image: str | None
    engine: dict

    @classmethod
    def of(cls, dep: dict) -> DeploymentView:
        spec, st = dep.get("spec") or {}, dep.get("status") or {}
        conds = {c.get("type"): c for c in st.get("conditions") or []}
        prog, fail = conds.get("Progressing") or {}, conds.get("ReplicaFailure") or {}
        containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
        server = next((c for c in containers if c.get("name") == CONTAINER), {})
        return cls(
            desired=spec.get("replicas", 1),
            observed=st.get("observedGeneration", 0) >= dep["metadata"].get("generation", 0),
            replicas=st.get("replicas") or 0,
            updated=st.get("updatedReplicas") or 0,
            ready=st.get("readyReplicas") or 0,
            available=st.get("availableReplicas") or 0,
            deadline_exceeded=prog.get("message", "progress deadline exceeded")
            if prog.get("reason") == "ProgressDeadlineExceeded"
            else None,
            replica_failure=fail.get("message", "replica failure")
            if fail.get("status") == "True"
            else None,
            image=server.get("image"),
            engine=read_engine_settings(dep),
        )

    @property
    def rollout_complete(self) -> bool:
        return (
            self.observed
            and self.updated >= self.desired
            and self.replicas == self.updated
            and self.available >= self.desired
        )


def _condition(
    prev: dict | None,
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> dict:
    value = "True" if status else "False"
    old = find_condition(prev, type_)
    since = old.get("lastTransitionTime") if old and old.get("status") == value else None
    return {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": clip(message),  # may quote a replica's or the API server's answer
        "lastTransitionTime": since or now,
        "observedGeneration": generation,
    }


# Each condition as (status, reason, message), from the Deployment (None: none serves) and
# the spec problem the operator found (None: none).


def ready(
    d: DeploymentView | None, problem: Problem | None, to_activator: bool = False
) -> tuple[bool, str, str]:
    if d is None:
        detail = f": {problem.message}" if problem else ""
        return (
            False,
            problem.reason if problem else "DeploymentMissing",
            "no serving Deployment" + detail,
        )
    if d.desired == 0:
        if to_activator:
            return True, "ScaledToZero", "0 replicas: the activator holds requests and wakes it"
        return False, "ScaledToZero", "0 replicas requested"
    message = f"{d.ready}/{d.desired} replicas ready"
    if d.ready >= d.desired:
        return True, "MinimumReplicasReady", message
    return False, "ReplicasNotReady", message


def progressing(d: DeploymentView | None, problem: Problem | None) -> tuple[bool, str, str]:
    if problem:
        return False, problem.reason, "the spec is not applied"
    if d is None:
        return True, "Reconciling", "creating the serving Deployment"
    if d.deadline_exceeded:
        return False, "ProgressDeadlineExceeded", d.deadline_exceeded
    if d.rollout_complete:
        return False, "RolloutComplete", f"{d.updated}/{d.desired} replicas updated and available"
    return (
        True,
        "RolloutInProgress",
        f"{d.updated}/{d.desired} replicas updated, {d.ready} ready, {d.replicas} total",
    )


def waiting_ready(
    d: DeploymentView | None, problem: Problem | None, to_activator: bool, filling: bool
) -> tuple[bool, str, str]:
    """Ready, or why not while the model cache fills before the first Deployment."""
    if filling and d is None:
        return False, MODEL_CACHE_FILLING, "no serving Deployment: the model cache is filling"
    return ready(d, problem, to_activator)


def waiting_progressing(
    d: DeploymentView | None, problem: Problem | None, filling: bool
) -> tuple[bool, str, str]:
    """Progressing: a fill is a change under way (the Deployment, if any, waits for it)."""
    if filling:
        return True, MODEL_CACHE_FILLING, "the model cache is filling; the pods follow"
    return progressing(d, problem)


def adapter_failures(prev: dict | None) -> str | None:
    """The adapters some replica refused, from status.adapters (the adapter sync's), as one
    message; None when none failed."""
    failed = [
        f"{a.get('name')} on {r.get('pod')}: {r.get('message', '')}"
        for a in (prev or {}).get("adapters") or []
        if isinstance(a, dict)
        for r in a.get("replicas") or []
        if isinstance(r, dict) and r.get("state") == "Failed"
    ]
    if not failed:
        return None
    more = len(failed) - MAX_ADAPTER_FAILURES_NAMED
    tail = f"; and {more} more" if more > 0 else ""
    return "adapter load failed: " + "; ".join(failed[:MAX_ADAPTER_FAILURES_NAMED]) + tail


def picker_failure(picker: dict | None) -> str | None:
    """Why the deployed endpoint picker's Deployment cannot run, from its conditions; None
    when it can (or there is none)."""
    if picker is None:
        return None
    p = DeploymentView.of(picker)
    why = p.replica_failure or p.deadline_exceeded
    return f"endpoint picker Deployment {picker['metadata']['name']}: {why}" if why else None


def kept_picker_failure(prev: dict | None, generation: int) -> str | None:
    """The picker failure recorded for this generation (a server Deployment's event reads
    no picker)."""
    c = find_condition(prev, DEGRADED) or {}
    if c.get("reason") == PICKER_UNAVAILABLE and c.get("observedGeneration") == generation:
        return c.get("message", "")
    return None


def degraded(
    d: DeploymentView | None,
    problem: Problem | None,
    adapters_failed: str | None = None,
    picker_failed: str | None = None,
) -> tuple[bool, str, str]:
    if problem:
        return True, problem.reason, problem.message
    if d and d.replica_failure:
        return True, "ReplicaFailure", d.replica_failure
    if d and d.deadline_exceeded:
        return True, "ProgressDeadlineExceeded", d.deadline_exceeded
    if picker_failed:
        return True, PICKER_UNAVAILABLE, picker_failed
    if adapters_failed:
        return True, ADAPTER_FAILED, adapters_failed
    return False, "AsExpected", ""


def loop_blind(prev: dict | None) -> tuple[bool, str, str] | None:
    """From what the closed loop last wrote (status.metrics.loopBlind); None while no
    loop has run for this service."""
    metrics = (prev or {}).get("metrics")
    if not isinstance(metrics, dict):
        return None
    why = metrics.get("loopBlind")
    if why:
        return True, "ReplicasUnscraped", str(why)
    return False, "ReplicasScraped", "enough replicas answer their scrape to decide"


def plant_degraded(prev: dict | None, now: float) -> tuple[bool, str, str] | None:
    """From the tuner's model (status.tuning.model): True while a change of the machine
    (its step time left the model) freezes tuning; None before the tuner has a model."""
    model = ((prev or {}).get("tuning") or {}).get("model")
    if not isinstance(model, dict):
        return None
    until = model.get("degradedUntil")
    if isinstance(until, int | float) and now < until:
        why = str(model.get("degradedReason") or "the step time left the model")
        return True, "StepTimeChanged", f"{why}: tuning frozen"
    return False, "StepTimeAsModelled", "the replicas' step time matches the tuner's model"


def compute_status(
    *,
    name: str,
    generation: int,
    prev: dict | None,
    deployment: dict | None,
    problem: Problem | None,
    url: str | None,
    now: str | None = None,
    to_activator: bool = False,
    cache: CacheState | None = None,
    picker_failed: str | None = None,
) -> dict:
    """The status to merge-patch. Fields owned by the loops (metrics, autoscaling, tuning)
    are left out, so a merge patch keeps them."""
    now = now or now_rfc3339()
    d = DeploymentView.of(deployment) if deployment else None
    filling = cache is not None and cache.reason == CACHE_FILLING and problem is None
    status: dict = {
        "observedGeneration": generation,
        "replicas": d.replicas if d else 0,
        "readyReplicas": d.ready if d else 0,
        "updatedReplicas": d.updated if d else 0,
        "selector": selector_string(name),
        "conditions": [
            _condition(
                prev, READY, *waiting_ready(d, problem, to_activator, filling), generation, now
            ),
            _condition(
                prev, PROGRESSING, *waiting_progressing(d, problem, filling), generation, now
            ),
            _condition(
                prev,
                DEGRADED,
                *degraded(d, problem, adapter_failures(prev), picker_failed),
                generation,
                now,
            ),
        ],
    }
    if cache is not None:
        state = (cache.ready, cache.reason, cache.message)
        status["conditions"].append(_condition(prev, MODEL_CACHE_READY, *state, generation, now))
    blind = loop_blind(prev)
    if blind is not None:
        status["conditions"].append(_condition(prev, LOOP_BLIND, *blind, generation, now))
    degraded_plant = plant_degraded(prev, time.time())
    if degraded_plant is not None:
        status["conditions"].append(
            _condition(prev, PLANT_DEGRADED, *degraded_plant, generation, now)
        )
    if url:
        status["url"] = url
    if d and d.image:
        status["image"] = d.image
    if d and d.engine:
        status["engine"] = d.engine
    return status
