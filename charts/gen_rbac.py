"""Write charts/batchpilot/files/rbac-rules.yaml from operator/rbac.py (the one source of the
operator's permissions). `make chart` runs it; tests/integration/test_chart.py fails when the
file is stale and checks that the chart's rendered Roles grant exactly these rules.

The chart binds the cluster-scoped resources with a ClusterRole and, in watchNamespaces mode,
the namespaced ones with a Role per namespace, so each rule is split by scope here.
Rules for optional features are written under `optional.<feature>`, and the chart grants
them only when `autoscaling.<feature>.enabled`: the rules of RULES on an API group of
OPTIONAL_GROUPS, and any module attribute <FEATURE>_RULES besides RULES.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from batchpilot.operator import rbac

OUT = Path(__file__).resolve().parent / "batchpilot" / "files" / "rbac-rules.yaml"

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


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if OUT.read_text() == render() else 1)
    OUT.write_text(render())
