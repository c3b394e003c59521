"""Which existing objects an InferenceService may change: only those it controls.

An InferenceService `web` names its children `web`, `web-engine`, ... Objects of those names
may already exist, made by someone else; the operator must neither take them over (apply
forces its fields and adds its owner reference, so deleting the InferenceService would then
garbage-collect them) nor delete them. Pure functions on plain dicts; reconcile.py reads the
live objects and acts on the verdicts.
"""

from __future__ import annotations

from collections.abc import Mapping

from batchpilot.operator.children.meta import Owner
from batchpilot.operator.crd.api import GROUP, KIND

NAME_CONFLICT_HINT = "rename the InferenceService, or delete or rename the object"


def controller_owner(body: Mapping) -> tuple[str, str] | None:
    """(namespace, name) of the InferenceService controlling this child, if any."""
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        ours = ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(GROUP + "/")
        if ours and ref.get("controller"):
            return body["metadata"]["namespace"], ref["name"]
    return None


def controller(obj: dict) -> dict | None:
    """The controller owner reference of an object, if any."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


def controlled_by(obj: dict, owner: Owner) -> bool:
    """Is ``obj`` controlled by exactly this InferenceService (its uid, not just its name:
    a deleted and recreated InferenceService is another object)?"""
    ref = controller(obj) or {}
    return (
        ref.get("uid") == owner.uid
        and ref.get("kind") == KIND
        and ref.get("apiVersion", "").startswith(GROUP + "/")
    )


def describe_controller(obj: dict) -> str:
    ref = controller(obj)
    if ref is None:
        return "with no controller"
    return f"controlled by {ref.get('kind')} {ref.get('name')!r} (uid {ref.get('uid')})"


def conflict(kind: str, live: dict | None, owner: Owner) -> str | None:
    """Why the existing object of a child's name is not this InferenceService's to change;
    None when there is none or it is ours."""
    if live is None or controlled_by(live, owner):
        return None
    return f"{kind} {live['metadata']['name']!r} exists, {describe_controller(live)}"


def conflicts_message(conflicts: list[str]) -> str:
    return "; ".join(conflicts) + f": left untouched ({NAME_CONFLICT_HINT})"


def delete_preconditions(live: dict) -> dict:
    """Delete exactly the object that was checked: not one made in its place since."""
    meta = live["metadata"]
    return {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]}


def pin(live: dict) -> dict:
    """Metadata that makes an apply a compare-and-swap on the object that was checked: the
    API server refuses it (409) if the object changed, or was replaced, since."""
    return {"resourceVersion": live["metadata"]["resourceVersion"]}
