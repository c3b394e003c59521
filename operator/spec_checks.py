"""What the reconcile checks before building anything: the spec parsed again (the installed
CRD may be older than this operator), the rules the schema cannot express, then the
objects it refers to and the kinds it needs served. Each problem is the status's."""

from __future__ import annotations

from batchpilot.operator import status
from batchpilot.operator.children.autoscaler import autoscaler_kind
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.children.picker import name_problem
from batchpilot.operator.children.plan import adapter_claims, source_claim
from batchpilot.operator.children.pod import (
    LABEL_SA_ALLOWED,
    service_account_allowed,
    spec_problems,
)
from batchpilot.operator.children.pool import INFERENCE_POOL_KIND
from batchpilot.operator.crd.spec import InferenceServiceSpec, SpecError, check_name, parse_spec
from batchpilot.operator.kube import Kube
from batchpilot.operator.status import Problem


def check_spec(
    kube: Kube, body: dict, ns: str
) -> tuple[InferenceServiceSpec | None, Problem | None]:
    """The parsed spec and its first problem, cheapest checks first."""
    try:
        check_name(body["metadata"]["name"])
        spec = parse_spec(body.get("spec"))
    except SpecError as e:
        return None, Problem(status.INVALID_SPEC, str(e))
    problems = spec_problems(spec)
    epp = spec.routing.picker
    if epp is not None and (taken := name_problem(Owner.from_body(body), epp)):
        problems.append(taken)
    if problems:
        return spec, Problem(status.INVALID_SPEC, "; ".join(problems))
    return spec, reference_problem(kube, spec, ns) or served_problem(kube, spec)


def reference_problem(kube: Kube, spec: InferenceServiceSpec, ns: str) -> Problem | None:
    """A claim or ServiceAccount the spec names that is missing, or not allowed."""
    claim = source_claim(spec)
    if claim and not kube.pvc_exists(ns, claim):
        return Problem(
            status.MODEL_SOURCE_NOT_FOUND,
            f"model source {spec.model.source}: PersistentVolumeClaim "
            f"{claim!r} not found in namespace {ns!r}",
        )
    missing = [c for c in adapter_claims(spec) if not kube.pvc_exists(ns, c)]
    if missing:
        # Mounting a missing claim would leave the new pods Pending: refused up front.
        return Problem(
            status.ADAPTER_SOURCE_NOT_FOUND,
            f"spec.adapters: PersistentVolumeClaim(s) {', '.join(missing)} not found in "
            f"namespace {ns!r}",
        )
    sa = spec.pod.service_account_name
    account = kube.read_service_account(ns, sa) if sa else None
    if sa and account is None:
        return Problem(
            status.SERVICE_ACCOUNT_NOT_FOUND,
            f"spec.pod.serviceAccountName: ServiceAccount {sa!r} not found in namespace {ns!r}",
        )
    if account is not None and not service_account_allowed(account):
        return Problem(
            status.SERVICE_ACCOUNT_NOT_ALLOWED,
            f"spec.pod.serviceAccountName: ServiceAccount {sa!r} is not labelled "
            f"{LABEL_SA_ALLOWED}=allowed (whoever manages it decides whether "
            "InferenceServices may run as it)",
        )
    return None


def served_problem(kube: Kube, spec: InferenceServiceSpec) -> Problem | None:
    """A kind the spec asks for that the API server does not serve (a CRD not installed)."""
    kind = autoscaler_kind(spec)
    if kind and not kube.serves(*kind):
        return Problem(
            status.AUTOSCALER_NOT_SERVED,
            f"spec.autoscaling.mode {spec.autoscaling.mode}: the API server serves no "
            f"{kind[1]} ({kind[0]}); install it or choose another mode",
        )
    if spec.routing.inference_pool and not kube.serves(*INFERENCE_POOL_KIND):
        api_version, kind = INFERENCE_POOL_KIND
        return Problem(
            status.INFERENCE_POOL_NOT_SERVED,
            f"spec.routing.inferencePool: the API server serves no {kind} ({api_version}); "
            "install the Gateway API Inference Extension's CRDs or turn it off",
        )
    return None
