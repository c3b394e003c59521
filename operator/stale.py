"""The children no spec asks for any more, deleted by the reconcile after it applied the
rest: optional kinds turned off (an HPA, a ScaledObject, an InferencePool, the
activator's EndpointSlice) and the endpoint picker's objects. Only the service's own,
exactly as found: an object of that name made by someone else stays."""

from __future__ import annotations

from collections.abc import Mapping

from batchpilot.operator import ownership
from batchpilot.operator.children.build import stale_kinds
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.children.picker import PICKER_KINDS, owned_selector
from batchpilot.operator.crd.spec import InferenceServiceSpec
from batchpilot.operator.kube import Kube


def first_build(prev: Mapping, found: Mapping) -> bool:
    """Nothing was ever built for this object: never reconciled (no observedGeneration)
    and no child of its names found. Children are written in apply order (build_children),
    the optional and endpoint-picker ones after the Deployment, so no earlier round left
    one to delete: the stale checks (a read per optional kind, a list) are skipped at the
    first build (three requests of each service's first at 1,000 services). Any later
    round, the timer's resync included, makes them."""
    return prev.get("observedGeneration") is None and not any(found.values())


def delete_stale(kube: Kube, owner: Owner, spec: InferenceServiceSpec, *, to_activator: bool):
    """Delete the optional children not asked for now: only this object's own, exactly
    as found (an object of that name made by someone else stays)."""
    for api_version, kind in stale_kinds(spec, to_activator=to_activator):
        if not kube.serves(api_version, kind):
            continue
        live = kube.read(api_version, kind, owner.namespace, owner.name)
        if live is not None and ownership.controlled_by(live, owner):
            preconditions = ownership.delete_preconditions(live)
            kube.delete(api_version, kind, owner.namespace, owner.name, preconditions)


def delete_stale_picker(kube: Kube, owner: Owner, children: list[dict]) -> None:
    """Delete the endpoint picker's objects not built now (turned off, or renamed): only
    this object's own. Its Deployment is deleted last, so other stale objects are left
    only beside a stale Deployment: one list answers for a service with nothing stale
    (one whose stale Deployment someone else deleted keeps the rest until it goes)."""
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
    selector = owned_selector(owner)
    deployments = kube.list("apps/v1", "Deployment", owner.namespace, selector)
    if all(("Deployment", d["metadata"]["name"]) in wanted for d in deployments):
        return
    for api_version, kind in PICKER_KINDS:
        for obj in kube.list(api_version, kind, owner.namespace, selector):
            name = obj["metadata"]["name"]
            if (kind, name) not in wanted and ownership.controlled_by(obj, owner):
                preconditions = ownership.delete_preconditions(obj)
                kube.delete(api_version, kind, owner.namespace, name, preconditions)
