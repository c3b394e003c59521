"""Has someone else changed a child, and what to write back: comparisons of the manifests
the builders declare against the live objects, and of server-side apply's managed fields.

Pure functions on plain dicts; the handlers decide when to call them.
"""

from __future__ import annotations

# What each kind declares besides metadata: the parts the operator owns outright.
_OWNED_PARTS = ("spec", "data", "type")
# Values the API server allocates once and keeps: carried over from the live object when
# the declared parts are replaced.
_ALLOCATED = {"Service": ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy")}
# Kinds whose spec the API server normalizes (defaults inside a pod template): only their
# metadata is compared, spec edits show as a new metadata.generation instead.
_GENERATION_TRACKED = frozenset(["Deployment"])


def contains(actual: object, desired: object) -> bool:
    """Does ``actual`` carry every field of ``desired`` with the same value? Maps may have
    more keys (server defaults, other managers' fields); lists match element-wise."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            k in actual and contains(actual[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(contains(a, d) for a, d in zip(actual, desired, strict=True))
        )
    return actual == desired


def drifted(desired: dict, actual: dict) -> bool:
    """Has someone changed what the operator applied? For a Deployment only its metadata is
    compared here; the handlers track its spec through metadata.generation."""
    meta_keys = ("labels", "annotations", "ownerReferences")
    want = {"metadata": {k: v for k, v in desired["metadata"].items() if k in meta_keys}}
    if desired["kind"] not in _GENERATION_TRACKED:
        want |= {k: v for k, v in desired.items() if k not in ("metadata", "apiVersion", "kind")}
    return not contains(actual, want)


def foreign_managers(live: dict, manager: str) -> list[str]:
    """Field managers other than ``manager`` that own part of a child's declared content
    (fields someone added by hand: server-side apply keeps those, it only forces the fields
    the operator sets). Status writers do not count."""
    out = []
    for entry in live.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") == manager or entry.get("subresource") == "status":
            continue
        owned = entry.get("fieldsV1") or {}
        if any(f"f:{part}" in owned for part in (*_OWNED_PARTS, "stringData")):
            out.append(entry.get("manager", "?"))
    return out


def restored(live: dict, desired: dict) -> dict:
    """The live object with the declared parts replaced wholesale by the desired ones: a
    full update (PUT) of this drops whatever others added there."""
    body = {k: v for k, v in live.items() if k not in ("status", *_OWNED_PARTS, "stringData")}
    body["metadata"] = {k: v for k, v in live["metadata"].items() if k != "managedFields"}
    for part in _OWNED_PARTS:
        if part in desired:
            body[part] = desired[part]
    for key in _ALLOCATED.get(desired["kind"], ()):
        if key in (live.get("spec") or {}):
            body["spec"] = {**body["spec"], key: live["spec"][key]}
    return body
