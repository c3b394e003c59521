"""ownership.py's verdicts: which existing objects an InferenceService may change."""

from __future__ import annotations

from batchpilot.operator import ownership
from batchpilot.operator.children.meta import Owner, owner_reference

OWNER = Owner(name="web", namespace="team-a", uid="uid-web")


def obj(*refs: dict, name: str = "web") -> dict:
    meta = {"name": name, "namespace": "team-a", "uid": "uid-obj", "resourceVersion": "42"}
    if refs:
        meta["ownerReferences"] = list(refs)
    return {"kind": "Deployment", "metadata": meta}


def ref(**kw) -> dict:
    return {**owner_reference(OWNER), **kw}


def test_only_the_controller_with_this_uid_owns():
    assert ownership.controlled_by(obj(ref()), OWNER)
    # Another object of the same name (deleted and recreated): another uid.
    assert not ownership.controlled_by(obj(ref(uid="uid-earlier")), OWNER)
    # An owner reference that does not control, or of another kind or group.
    assert not ownership.controlled_by(obj(ref(controller=False)), OWNER)
    assert not ownership.controlled_by(obj(ref(kind="Deployment")), OWNER)
    assert not ownership.controlled_by(obj(ref(apiVersion="evil.example/v1")), OWNER)
    assert not ownership.controlled_by(obj(), OWNER)
    # A non-controlling reference next to ours changes nothing.
    other = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u"}
    assert ownership.controlled_by(obj(other, ref()), OWNER)


def test_conflict_names_the_object_and_its_controller():
    assert ownership.conflict("Deployment", None, OWNER) is None
    assert ownership.conflict("Deployment", obj(ref()), OWNER) is None
    assert (
        ownership.conflict("Deployment", obj(), OWNER)
        == "Deployment 'web' exists, with no controller"
    )
    why = ownership.conflict("Service", obj(ref(uid="uid-earlier")), OWNER)
    assert why == "Service 'web' exists, controlled by InferenceService 'web' (uid uid-earlier)"
    message = ownership.conflicts_message(
        [why, "ConfigMap 'web-engine' exists, with no controller"]
    )
    assert message.startswith("Service 'web' exists") and "ConfigMap 'web-engine'" in message
    assert message.endswith(f": left untouched ({ownership.NAME_CONFLICT_HINT})")


def test_writes_and_deletes_are_pinned_to_what_was_checked():
    checked = obj(ref())
    assert ownership.pin(checked) == {"resourceVersion": "42"}
    assert ownership.delete_preconditions(checked) == {"uid": "uid-obj", "resourceVersion": "42"}
