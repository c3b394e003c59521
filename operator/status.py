"""Pure status computation: the InferenceService's status from its serving Deployment and
from what the operator found wrong with the spec.

Conditions follow Kubernetes conventions (metav1.Condition): type, status, reason, message,
lastTransitionTime (kept while the status does not change) and observedGeneration.

- Ready: enough replicas are ready to serve (True even mid-rollout: maxUnavailable is 0).
- Progressing: a rollout is under way (False with RolloutComplete once it is done).
- Degraded: the spec cannot be applied as is (InvalidSpec, ModelSourceNotFound, ...), or the
  Deployment reports ReplicaFailure or ProgressDeadlineExceeded.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from batchpilot.operator import resources

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"

# Problems the operator finds with the spec or with applying it. A status refresh from a Deployment event keeps
# them for the generation they were found in; the next full reconcile re-evaluates them.
INVALID_SPEC = "InvalidSpec"
MODEL_SOURCE_NOT_FOUND = "ModelSourceNotFound"
SERVICE_ACCOUNT_NOT_FOUND = "ServiceAccountNotFound"
APPLY_FAILED = "ApplyFailed"  # the API server refused the children (RBAC, a bad request)
SPEC_REASONS = frozenset(
    [INVALID_SPEC, MODEL_SOURCE_NOT_FOUND, SERVICE_ACCOUNT_NOT_FOUND, APPLY_FAILED]
)


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


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
        server = next((c for c in containers if c.get("name") == resources.CONTAINER), {})
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
            engine=resources.parse_engine_args(server.get("args") or []),
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
    prev: dict | None, type_: str, status: str, reason: str, message: str, generation: int, now: str
) -> dict:
    old = find_condition(prev, type_)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else None
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or now,
        "observedGeneration": generation,
    }


def compute_status(
    *,
    name: str,
    generation: int,
    prev: dict | None,
    deployment: dict | None,
    problem: Problem | None,
    url: str | None,
    now: str | None = None,
) -> dict:
    """The status to merge-patch. Fields owned by the loops (metrics, autoscaling, tuning)
    are left out, so a merge patch keeps them."""
    now = now or now_rfc3339()
    prev = prev or {}
    d = DeploymentView.of(deployment) if deployment else None

    def cond(type_: str, status: bool, reason: str, message: str) -> dict:
        return _condition(
            prev, type_, "True" if status else "False", reason, message, generation, now
        )

    if d is None:
        ready = cond(
            READY,
            False,
            problem.reason if problem else "DeploymentMissing",
            "no serving Deployment" + (f": {problem.message}" if problem else ""),
        )
    elif d.desired == 0:
        ready = cond(READY, False, "ScaledToZero", "0 replicas requested")
    elif d.ready >= d.desired:
        ready = cond(READY, True, "MinimumReplicasReady", f"{d.ready}/{d.desired} replicas ready")
    else:
        ready = cond(READY, False, "ReplicasNotReady", f"{d.ready}/{d.desired} replicas ready")

    if problem:
        progressing = cond(PROGRESSING, False, problem.reason, "the spec is not applied")
        degraded = cond(DEGRADED, True, problem.reason, problem.message)
    elif d is None:
        progressing = cond(PROGRESSING, True, "Reconciling", "creating the serving Deployment")
        degraded = cond(DEGRADED, False, "AsExpected", "")
    else:
        if d.deadline_exceeded:
            progressing = cond(PROGRESSING, False, "ProgressDeadlineExceeded", d.deadline_exceeded)
        elif d.rollout_complete:
            progressing = cond(
                PROGRESSING,
                False,
                "RolloutComplete",
                f"{d.updated}/{d.desired} replicas updated and available",
            )
        else:
            progressing = cond(
                PROGRESSING,
                True,
                "RolloutInProgress",
                f"{d.updated}/{d.desired} replicas updated, {d.ready} ready, {d.replicas} total",
            )
        if d.replica_failure:
            degraded = cond(DEGRADED, True, "ReplicaFailure", d.replica_failure)
        elif d.deadline_exceeded:
            degraded = cond(DEGRADED, True, "ProgressDeadlineExceeded", d.deadline_exceeded)
        else:
            degraded = cond(DEGRADED, False, "AsExpected", "")

    status: dict = {
        "observedGeneration": generation,
        "replicas": d.replicas if d else 0,
        "readyReplicas": d.ready if d else 0,
        "updatedReplicas": d.updated if d else 0,
        "selector": resources.selector_string(name),
        "conditions": [ready, progressing, degraded],
    }
    if url:
        status["url"] = url
    if d and d.image:
        status["image"] = d.image
    if d and d.engine:
        status["engine"] = d.engine
    return status
