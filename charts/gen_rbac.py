"""Write charts/batchpilot/files/rbac-rules.yaml from operator/rbac.py (the one source of the
operator's permissions). `make chart` runs it; tests/integration/test_chart.py fails when the
file is stale and checks that the chart's rendered Roles grant exactly these rules.

The chart binds the cluster-scoped resources with a ClusterRole and, in watchNamespaces mode,
the namespaced ones with a Role per namespace, so each rule is split by scope here.
Optional rule sets (module attributes NAME_RULES besides RULES, e.g. HPA_RULES, KEDA_RULES)
are written under `optional.<name>`; the chart grants them only when that feature is enabled.
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
    optional = {
        name[: -len("_RULES")].lower(): split(value)
        for name, value in sorted(vars(rbac).items())
        if name.endswith("_RULES") and name != "RULES" and isinstance(value, list)
    }
    # A JSON round trip: plain copies, so the YAML has no anchors.
    return json.loads(json.dumps({"rules": split(rbac.RULES), "optional": optional}))


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
