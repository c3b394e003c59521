"""Write charts/batchpilot/files/rbac-rules.yaml from operator/rbac.py (the one source of the
operator's permissions), and files/activator-rbac-rules.yaml from its ACTIVATOR_PERMISSIONS
(the activator's, bound to the activator's own ServiceAccount: cluster-wide, or with a Role
in each watched namespace). `make chart` runs it; tests/integration/test_chart.py fails when
a file is stale and checks that the chart's rendered Roles grant exactly these rules.

The chart binds the cluster-scoped resources with a ClusterRole and, in watchNamespaces mode,
the namespaced ones with a Role per namespace, so each rule is split by scope here.
Rules for optional features are written under `optional.<feature>`, and the chart grants
them only when `autoscaling.<feature>.enabled`: the rules of RULES on an API group of
OPTIONAL_GROUPS, and any module attribute <FEATURE>_RULES besides RULES. The activator's
list is named ACTIVATOR_PERMISSIONS, not *_RULES, so that it stays out of the operator's file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from batchpilot.operator import rbac

FILES = Path(__file__).resolve().parent / "batchpilot" / "files"
OUT = FILES / "rbac-rules.yaml"
ACTIVATOR_OUT = FILES / "activator-rbac-rules.yaml"

# Cluster-scoped resources the operator may touch (everything else is namespaced).
CLUSTER_SCOPED = {
    "namespaces",
    "nodes",
    "persistentvolumes",
    "storageclasses",
    "customresourcedefinitions",
    "clusterkopfpeerings",
    "priorityclasses",
    "clusterroles",
    "clusterrolebindings",
}


# Optional features by the API groups their rules touch.
OPTIONAL_GROUPS = {"hpa": {"autoscaling"}, "keda": {"keda.sh"}}


def feature(rule: dict) -> str | None:
    for name, groups in OPTIONAL_GROUPS.items():
        if set(rule["apiGroups"]) <= groups:
            return name
    return None


def split(rules: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"cluster": [], "namespaced": []}
    for rule in rules:
        for scope in ("cluster", "namespaced"):
            resources = [
                r
                for r in rule["resources"]
                if (r.split("/")[0] in CLUSTER_SCOPED) == (scope == "cluster")
            ]
            if resources:
                out[scope].append({**rule, "resources": resources})
    return out


def document() -> dict:
    extra: dict[str, list[dict]] = {name: [] for name in OPTIONAL_GROUPS}
    for name, value in sorted(vars(rbac).items()):
        if name.endswith("_RULES") and name != "RULES" and isinstance(value, list):
            extra.setdefault(name[: -len("_RULES")].lower(), []).extend(value)
    for rule in rbac.RULES:
        if feature(rule):
            extra[feature(rule)].append(rule)
    required = [rule for rule in rbac.RULES if not feature(rule)]
    optional = {name: split(rules) for name, rules in extra.items() if rules}
    # A JSON round trip: plain copies, so the YAML has no anchors.
    return json.loads(json.dumps({"rules": split(required), "optional": optional}))


def render() -> str:
    header = (
        "# Generated from operator/rbac.py by charts/gen_rbac.py (`make chart`): do not edit.\n"
        "# cluster: bound cluster-wide; namespaced: cluster-wide, or per watched namespace.\n"
    )
    return header + yaml.safe_dump(document(), sort_keys=False, default_flow_style=None, width=100)


def render_activator() -> str:
    header = (
        "# Generated from ACTIVATOR_PERMISSIONS in operator/rbac.py by charts/gen_rbac.py\n"
        "# (`make chart`): do not edit. The activator's rules: a ClusterRole, or with\n"
        "# watchNamespaces a Role in each watched namespace.\n"
    )
    rules = json.loads(json.dumps(rbac.ACTIVATOR_PERMISSIONS))
    return header + yaml.safe_dump(
        {"rules": rules}, sort_keys=False, default_flow_style=None, width=100
    )


# Each generated file and the function that renders it.
OUTPUTS = {OUT: render, ACTIVATOR_OUT: render_activator}


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        stale = [p for p, make in OUTPUTS.items() if not p.exists() or p.read_text() != make()]
        for path in stale:
            print(f"stale: {path} (make chart)", file=sys.stderr)
        sys.exit(1 if stale else 0)
    for path, make in OUTPUTS.items():
        path.write_text(make())
