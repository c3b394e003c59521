"""The model cache (spec.model.cache): its state from the fill Job (pure), and
``ensure_cache``, the shell that creates the claim and the Job and reads them back.

The claim is only ever created (when no claim of its name exists) and never changed or
deleted: someone else's is used as it is, and the operator's own outlives the services, so
that the next one with the same model starts from it. The fill Job is the service's own
(owner reference, garbage-collected with it); its success is the cache's readiness. A
failed Job stays, so that its failure is seen: deleting it retries the fill."""

from __future__ import annotations

from batchpilot.operator import ownership, status
from batchpilot.operator.children.cache import (
    JOB_KIND,
    build_cache_claim,
    build_fill_job,
    fill_job_selector,
)
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.children.plan import cache_path
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.kube import ApiException, Kube
from batchpilot.operator.status import CacheState, Problem

PVC = ("v1", "PersistentVolumeClaim")


def _job_condition(job: dict, type_: str) -> dict | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def job_state(job: dict, claim: dict | None, path: str) -> CacheState:
    """The cache's state from its fill Job and claim."""
    name = job["metadata"]["name"]
    if _job_condition(job, "Complete") is not None:
        return CacheState(True, status.CACHE_FILLED, f"{path} filled by Job {name}")
    failed = _job_condition(job, "Failed")
    if failed is not None:
        why = f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}".rstrip(": ")
        message = f"Job {name} failed to fill {path} ({why}); delete the Job to retry"
        return CacheState(False, status.CACHE_FAILED, message)
    phase = ((claim or {}).get("status") or {}).get("phase")
    if phase not in (None, "Bound"):
        claim_name = claim["metadata"]["name"] if claim else "?"
        message = f"Job {name} waits for PersistentVolumeClaim {claim_name!r} ({phase})"
        return CacheState(False, status.CACHE_FILLING, message)
    return CacheState(False, status.CACHE_FILLING, f"Job {name} is filling {path}")


def settled(event_type: str | None, job: dict) -> bool:
    """A fill Job event the service's state changes on: one that finished, or was deleted
    (the reconcile makes it anew). Progress events change nothing, and neither does the
    listing at start (None): the resume handler reconciles every service then."""
    if event_type in (None, "DELETED"):
        return event_type == "DELETED"
    return any(_job_condition(job, t) is not None for t in ("Complete", "Failed"))


def _ensure_claim(kube: Kube, owner: Owner, spec: InferenceServiceSpec) -> dict:
    """The claim, created when absent (409: made meanwhile, read it)."""
    claim = build_cache_claim(owner, spec)
    found = kube.read(*PVC, owner.namespace, claim["metadata"]["name"])
    if found is not None:
        return found
    try:
        return kube.create(claim)
    except ApiException as e:
        if e.status != 409:
            raise
    return kube.read(*PVC, owner.namespace, claim["metadata"]["name"]) or claim


def _delete_stale_jobs(kube: Kube, owner: Owner, keep: str) -> None:
    """The service's fill Jobs for an earlier source or image: only its own, as found."""
    for job in kube.list(*JOB_KIND, owner.namespace, fill_job_selector(owner.name)):
        name = job["metadata"]["name"]
        if name != keep and ownership.controlled_by(job, owner):
            preconditions = ownership.delete_preconditions(job)
            kube.delete(*JOB_KIND, owner.namespace, name, preconditions, propagation="Background")


def ensure_cache(
    kube: Kube, owner: Owner, spec: InferenceServiceSpec, image: str
) -> tuple[CacheState | None, Problem | None]:
    """The cache's state, after creating what is missing; (None, None) without a cache.
    A Job of the fill Job's name that is not this service's is a NameConflict; a failed
    fill is the ModelCacheFailed problem (Degraded). API errors are the caller's."""
    path = cache_path(spec, image)
    if path is None:
        return None, None
    claim = _ensure_claim(kube, owner, spec)
    job = build_fill_job(owner, spec, image)
    name = job["metadata"]["name"]
    found = kube.read(*JOB_KIND, owner.namespace, name)
    if why := ownership.conflict("Job", found, owner):
        return None, Problem(status.NAME_CONFLICT, ownership.conflicts_message([why]))
    if found is None:
        found = kube.create(job)
    _delete_stale_jobs(kube, owner, keep=name)
    state = job_state(found, claim, path)
    failed = state.reason == status.CACHE_FAILED
    return state, Problem(status.MODEL_CACHE_FAILED, state.message) if failed else None
