"""The Helm chart (charts/batchpilot): its sources stay in step with the package, it lints,
every values file renders to manifests the API server accepts, and an install on the loopback
control plane (kwok node) runs the operator with exactly operator/rbac.py's permissions, and
the activator with exactly its ACTIVATOR_PERMISSIONS in the namespaces it serves. The
activator's admission policy, enforced by that API server, lets it change nothing of an
InferenceService but the wake annotation.

Static checks (version, CRDs, generated RBAC files) need nothing; the rest uses the `k8s`
fixture (tier `cluster`) for its helm and kubectl binaries and API server.
"""

from __future__ import annotations

import base64
import filecmp
import importlib.util
import json
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client

import batchpilot
from batchpilot.operator import rbac
from batchpilot.operator.children.meta import PORT_NAME
from batchpilot.operator.children.service import SLICE_SERVICE_NAME, activator_of
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.crd.api import GROUP, PLURAL, VERSION
from batchpilot.operator.loop.idle import WAKE_ANNOTATION
from tests.support.cluster import install_crds
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "batchpilot"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
OPERATOR_SA_GROUPS = ["system:serviceaccounts", "system:authenticated"]
# The names `render` gives (release bp, namespace batchpilot-system).
FULLNAME = "bp-batchpilot"
ACTIVATOR = f"{FULLNAME}-activator"
ADMISSION_POLICY = f"{ACTIVATOR}-wake-only"


def _gen_rbac():
    spec = importlib.util.spec_from_file_location("gen_rbac", REPO / "charts" / "gen_rbac.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expand(rules: list[dict]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples: rule sets compare equal however they are split."""
    return {
        (g, r, v)
        for rule in rules
        for g in rule.get("apiGroups", [])
        for r in rule.get("resources", [])
        for v in rule.get("verbs", [])
    }


# --- static: no cluster needed


def test_chart_versions_follow_the_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == batchpilot.__version__
    assert chart["version"] == batchpilot.__version__


def test_chart_crds_are_the_generated_crds():
    root = REPO / "crds"
    names = sorted(p.name for p in root.glob("*.yaml"))
    assert names == sorted(p.name for p in (CHART / "crds").glob("*.yaml")), (
        "charts/batchpilot/crds/ must hold exactly the files of crds/ (cp crds/*.yaml charts/batchpilot/crds/)"
    )
    _, mismatch, errors = filecmp.cmpfiles(root, CHART / "crds", names, shallow=False)
    assert not mismatch and not errors, f"differ from crds/: {mismatch + errors} (make chart)"


def test_chart_rbac_file_is_generated_from_operator_rbac():
    gen = _gen_rbac()
    assert gen.OUT.read_text() == gen.render(), "stale files/rbac-rules.yaml: run `make chart`"
    doc = gen.document()
    every = doc["rules"]["cluster"] + doc["rules"]["namespaced"]
    for sets in doc["optional"].values():
        every += sets["cluster"] + sets["namespaced"]
    assert expand(every) == expand(rbac.RULES)
    # The activator's permissions are not an optional feature of the operator.
    assert "activator" not in doc["optional"]


def test_chart_activator_rbac_file_is_generated_from_activator_permissions():
    gen = _gen_rbac()
    text = gen.ACTIVATOR_OUT.read_text()
    assert text == gen.render_activator(), "stale files/activator-rbac-rules.yaml: run `make chart`"
    assert yaml.safe_load(text)["rules"] == rbac.ACTIVATOR_PERMISSIONS


def test_values_schema_is_valid_json_with_every_top_level_value():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"]), set(values) - set(schema["properties"])


# --- with helm and the loopback API server


def helm(k8s, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return k8s.run_helm(*args, check=check)


def render(
    k8s, *args: str, release: str = "bp", namespace: str = "batchpilot-system"
) -> list[dict]:
    out = helm(k8s, "template", release, str(CHART), "--namespace", namespace, *args)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str = FULLNAME) -> dict:
    """The one object of that kind and name (default: the operator's)."""
    (doc,) = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def operator_env(docs: list[dict]) -> dict[str, dict]:
    (c,) = named(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in c["env"]}


def test_helm_lint_strict(k8s):
    for values in VALUES_FILES:
        out = helm(k8s, "lint", "--strict", str(CHART), "-f", str(values), check=False)
        assert out.returncode == 0, f"{values.name}:\n{out.stdout}\n{out.stderr}"


@pytest.mark.parametrize("values", VALUES_FILES, ids=lambda p: p.stem)
def test_rendered_manifests_pass_server_side_validation(k8s, namespace, values):
    """Each manifest goes through the API server's own schema check (strict field
    validation): created for real in a fresh namespace, the test-hook Pod as a dry run once
    its ServiceAccount exists. The ServiceMonitor (a prometheus-operator CRD this cluster
    does not serve) is checked structurally instead."""
    install_crds(k8s)  # the KopfPeering kinds, as helm installs the chart's crds/ first
    release = f"v-{uuid.uuid4().hex[:6]}"
    docs = render(k8s, "-f", str(values), release=release, namespace=namespace)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ClusterRole", "ClusterRoleBinding"} <= kinds, kinds
    for ns in sorted({d["metadata"].get("namespace") for d in docs} - {None, namespace}):
        k8s.run_kubectl("create", "namespace", ns, check=False)
    values_doc = yaml.safe_load(values.read_text()) or {}
    if not values_doc.get("serviceAccount", {}).get("create", True):
        k8s.run_kubectl(
            "create", "serviceaccount", values_doc["serviceAccount"]["name"], "-n", namespace
        )
    created = []
    try:
        for doc in sorted(docs, key=lambda d: d["kind"] == "Pod"):
            if doc["kind"] == "ServiceMonitor":
                assert doc["apiVersion"] == "monitoring.coreos.com/v1"
                assert doc["spec"]["endpoints"][0]["port"] == "http"
                continue
            dry = ["--dry-run=server"] if doc["kind"] == "Pod" else []
            out = k8s.run_kubectl(
                "create", *dry, "--validate=strict", "-f", "-", "-o", "name",
                input=yaml.safe_dump(doc), check=False,
            )  # fmt: skip
            assert out.returncode == 0, f"{values.name}: {doc['kind']}: {out.stderr}"
            if not dry:
                created.append(doc)
    finally:
        for doc in created:
            ns = ["-n", doc["metadata"]["namespace"]] if doc["metadata"].get("namespace") else []
            k8s.run_kubectl(
                "delete", doc["kind"].lower(), doc["metadata"]["name"], *ns, "--wait=false",
                check=False,
            )  # fmt: skip


def test_deployment_hardening_and_args(k8s):
    docs = render(k8s)
    dep = named(docs, "Deployment")
    spec = dep["spec"]
    # Two replicas peered through the ClusterKopfPeering the chart makes: rolled one by one.
    assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
    assert named(docs, "ClusterKopfPeering")["metadata"]["name"] == FULLNAME
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["image"] == f"ghcr.io/batchpilot/batchpilot-operator:{batchpilot.__version__}"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert "--all-namespaces" in c["args"] and f"--peering={FULLNAME}" in c["args"]
    assert "--peering-lifetime=20" in c["args"] and "--standalone" not in c["args"]
    assert "--loop-interval=15" in c["args"]
    docs = render(k8s, "--set", "watchNamespaces={a,b}", "--set", "serverImage.repository=s")
    (c,) = named(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--namespace=a" in c["args"] and "--namespace=b" in c["args"]
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(d["metadata"]["namespace"] for d in peerings) == ["a", "b"]
    assert not [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    assert f"--server-image=s:{batchpilot.__version__}" in c["args"]
    assert "--all-namespaces" not in c["args"]
    # One replica: standalone, replaced by Recreate, no peering object.
    docs = render(k8s, "--set", "operator.replicas=1")
    dep = named(docs, "Deployment")
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    assert "--standalone" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [d for d in docs if d["kind"].endswith("KopfPeering")]


def test_operator_pod_meets_the_restricted_pod_security_standard(k8s):
    """The operator's pod, the activator's and the test hook's: what `restricted` checks (the
    install test also runs them in a namespace that enforces it)."""
    docs = render(k8s)
    pods = [
        named(docs, "Deployment")["spec"]["template"]["spec"],
        named(docs, "Deployment", ACTIVATOR)["spec"]["template"]["spec"],
        by_kind(docs, "Pod")[0]["spec"],
    ]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert key not in pod
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
            assert sc["capabilities"] == {"drop": ["ALL"]}


def test_admin_key_secret_and_the_operators_environment(k8s):
    """The key the admin tokens derive from reaches the operator through its environment
    (the kubelet reads the Secret): the chart's random one, or an existing Secret."""
    docs = render(k8s)
    (secret,) = by_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "bp-batchpilot-admin-key"
    assert len(base64.b64decode(secret["data"]["key"])) == 48
    (c,) = named(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    ref = {"name": "bp-batchpilot-admin-key", "key": "key"}
    assert env["BATCHPILOT_ADMIN_KEY"]["valueFrom"] == {"secretKeyRef": ref}
    assert not any("admin-key" in a or "ADMIN_KEY" in a for a in c["args"])
    docs = render(k8s, "--set", "operator.adminKey.existingSecret=mine")
    assert not by_kind(docs, "Secret")
    env = operator_env(docs)
    assert env["BATCHPILOT_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "mine"


def servers_policies(docs: list[dict]) -> list[dict]:
    return [d for d in by_kind(docs, "NetworkPolicy") if d["metadata"]["name"] != ACTIVATOR]


def test_network_policy_admits_the_admin_port_from_the_operator_only(k8s):
    assert not by_kind(render(k8s), "NetworkPolicy")  # off by default
    docs = render(k8s, "--set", "networkPolicy.enabled=true", "--set", "watchNamespaces={a,b}")
    policies = servers_policies(docs)
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["a", "b"]
    operator_labels = named(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    for policy in policies:
        spec = policy["spec"]
        assert spec["podSelector"] == {
            "matchLabels": {"app.kubernetes.io/name": "batchpilot-server"}
        }
        assert spec["policyTypes"] == ["Ingress"]
        serving, admin = spec["ingress"]
        assert serving == {"ports": [{"port": "http", "protocol": "TCP"}]}  # from anywhere
        assert admin["ports"] == [{"port": "admin", "protocol": "TCP"}]
        assert admin["from"] == [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "batchpilot-system"}
                },
                "podSelector": {"matchLabels": operator_labels},
            }
        ]
    docs = render(
        k8s, "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.namespaces={c}"
    )
    assert [p["metadata"]["namespace"] for p in servers_policies(docs)] == ["c"]
    out = helm(
        k8s, "template", "bp", str(CHART), "--set", "networkPolicy.enabled=true", check=False
    )
    assert out.returncode != 0 and "networkPolicy.namespaces" in out.stderr, out.stderr


def optional_rules(gen, *features: str) -> set[tuple[str, str, str]]:
    doc = gen.document()["optional"]
    return {
        t for f in features if f in doc for t in expand(doc[f]["cluster"] + doc[f]["namespaced"])
    }


def test_rendered_rbac_is_exactly_operator_rbac(k8s):
    gen = _gen_rbac()
    everything = ["--set", "autoscaling.hpa.enabled=true", "--set", "autoscaling.keda.enabled=true"]
    nothing = ["--set", "autoscaling.hpa.enabled=false", "--set", "autoscaling.keda.enabled=false"]
    # Every namespace, every feature: one ClusterRole with exactly rbac.RULES, no Roles.
    docs = render(k8s, *everything)
    cr = named(docs, "ClusterRole")
    assert expand(cr["rules"]) == expand(rbac.RULES)
    assert not by_kind(docs, "Role")
    # The defaults: HPA permissions (the API is always served), KEDA's only when enabled.
    cr = named(render(k8s), "ClusterRole")
    assert expand(cr["rules"]) == expand(rbac.RULES) - optional_rules(gen, "keda")
    cr = named(render(k8s, *nothing), "ClusterRole")
    assert expand(cr["rules"]) == expand(rbac.RULES) - optional_rules(gen, "hpa", "keda")
    # Namespaced mode: cluster-scoped rules cluster-wide, the rest in each watched namespace.
    docs = render(k8s, "--set", "watchNamespaces={team-a,team-b}", *everything)
    cr = named(docs, "ClusterRole")
    roles = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == FULLNAME]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    cluster_only = expand(gen.document()["rules"]["cluster"])
    assert expand(cr["rules"]) == cluster_only
    for role in roles:
        assert expand(role["rules"]) | cluster_only == expand(rbac.RULES)
        assert not expand(role["rules"]) & cluster_only
    bindings = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"] == FULLNAME]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    # RBAC apiGroups carry no version.
    for rule in cr["rules"] + roles[0]["rules"]:
        assert all("/" not in g for g in rule["apiGroups"]), rule


def activator_objects(docs: list[dict]) -> dict[str, dict]:
    """The activator's objects by kind: everything named <fullname>-activator."""
    found = [d for d in docs if d["metadata"]["name"] == ACTIVATOR]
    assert len({d["kind"] for d in found}) == len(found), [d["kind"] for d in found]
    return {d["kind"]: d for d in found}


def test_activator_renders_when_enabled_and_not_when_off(k8s):
    docs = render(k8s)
    objects = activator_objects(docs)
    kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"}
    assert set(objects) == kinds
    for obj in objects.values():
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "batchpilot-activator"
        assert labels["app.kubernetes.io/component"] == "activator"
        assert labels["app.kubernetes.io/instance"] == "bp"
        assert labels["app.kubernetes.io/part-of"] == "batchpilot"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
    dep, svc = objects["Deployment"], objects["Service"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert svc["spec"]["selector"] == selector
    # Neither the operator's Deployment nor the activator's selects the other's pods.
    operator = named(docs, "Deployment")
    operator_selector = operator["spec"]["selector"]["matchLabels"]
    assert not operator_selector.items() <= pod_labels.items()
    assert not selector.items() <= operator["spec"]["template"]["metadata"]["labels"].items()

    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == ACTIVATOR
    (c,) = pod["containers"]
    assert c["image"] == f"ghcr.io/batchpilot/batchpilot-operator:{batchpilot.__version__}"
    # The image's entrypoint is `batchpilot operator`: the activator replaces it.
    assert c["command"] == ["batchpilot"]
    assert c["args"] == [
        "activator",
        "--port=8000",
        "--cluster-domain=cluster.local",
        "--max-held-per-service=256",
        "--hold-timeout-seconds=300",
        "--max-body-bytes=4194304",
        "--max-held-bytes=134217728",
    ]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # Ready once its watches listed (/readyz); alive while it serves (/healthz).
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["resources"] == {
        "requests": {"cpu": "50m", "memory": "128Mi"},
        "limits": {"memory": "512Mi"},
    }
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]
    assert dep["spec"]["replicas"] == 1
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    binding = objects["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == ACTIVATOR
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": ACTIVATOR, "namespace": "batchpilot-system"}
    ]

    docs = render(
        k8s,
        "--set", "activator.port=9000",
        "--set", "activator.replicas=2",
        "--set", "activator.maxBodyBytes=16777216",
        "--set-json", "activator.holdTimeoutSeconds=90.5",
        "--set", "activator.extraArgs={--host=::}",
        "--set", "operator.clusterDomain=example.internal",
    )  # fmt: skip
    objects = activator_objects(docs)
    (c,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert objects["Deployment"]["spec"]["replicas"] == 2
    assert c["args"][1:] == [
        "--port=9000",
        "--cluster-domain=example.internal",
        "--max-held-per-service=256",
        "--hold-timeout-seconds=90.5",
        "--max-body-bytes=16777216",
        "--max-held-bytes=134217728",
        "--host=::",
    ]
    assert c["ports"][0]["containerPort"] == 9000
    assert objects["Service"]["spec"]["ports"][0]["port"] == 9000

    docs = render(k8s, "--set", "activator.enabled=false")
    assert not activator_objects(docs)
    assert not [d for d in docs if "activator" in d["metadata"]["name"]]
    assert "BATCHPILOT_ACTIVATOR_SERVICE" not in operator_env(docs)


def test_operator_is_pointed_at_the_activator_service(k8s):
    docs = render(k8s)
    env = operator_env(docs)["BATCHPILOT_ACTIVATOR_SERVICE"]
    svc = named(docs, "Service", ACTIVATOR)
    assert env == {
        "name": "BATCHPILOT_ACTIVATOR_SERVICE",
        "value": f"{svc['metadata']['namespace']}/{svc['metadata']['name']}",
    }
    assert env["value"] == f"batchpilot-system/{ACTIVATOR}"
    # The operator accepts it, and finds the port it reads there by name.
    assert OperatorConfig(activator_service=env["value"]).activator_service == env["value"]
    assert svc["spec"]["ports"][0]["name"] == PORT_NAME


def activator_rbac(docs: list[dict]) -> dict[str, list[dict]]:
    """The activator's ClusterRoles, ClusterRoleBindings, Roles and RoleBindings, by kind."""
    kinds = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    return {k: [d for d in by_kind(docs, k) if d["metadata"]["name"] == ACTIVATOR] for k in kinds}


def activator_args(docs: list[dict]) -> list[str]:
    (c,) = named(docs, "Deployment", ACTIVATOR)["spec"]["template"]["spec"]["containers"]
    return c["args"]


def test_activator_rbac_is_exactly_activator_permissions_where_it_serves(k8s):
    """Every namespace served: a ClusterRole. watchNamespaces: a Role and RoleBinding in each
    watched namespace, none cluster-wide, and the activator told to serve exactly those."""
    subject = [{"kind": "ServiceAccount", "name": ACTIVATOR, "namespace": "batchpilot-system"}]
    docs = render(k8s)
    found = activator_rbac(docs)
    (cr,) = found["ClusterRole"]
    assert cr["rules"] == rbac.ACTIVATOR_PERMISSIONS
    (binding,) = found["ClusterRoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ACTIVATOR,
    }  # fmt: skip
    assert binding["subjects"] == subject
    assert not found["Role"] and not found["RoleBinding"]
    assert not [a for a in activator_args(docs) if a.startswith("--namespace")]

    docs = render(k8s, "--set", "watchNamespaces={team-a,team-b}")
    found = activator_rbac(docs)
    assert not found["ClusterRole"] and not found["ClusterRoleBinding"]
    assert sorted(r["metadata"]["namespace"] for r in found["Role"]) == ["team-a", "team-b"]
    for role in found["Role"]:
        assert role["rules"] == rbac.ACTIVATOR_PERMISSIONS
        assert role["metadata"]["labels"]["app.kubernetes.io/name"] == "batchpilot-activator"
    bindings = {b["metadata"]["namespace"]: b for b in found["RoleBinding"]}
    assert sorted(bindings) == ["team-a", "team-b"]
    for binding in bindings.values():
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ACTIVATOR,
        }  # fmt: skip
        assert binding["subjects"] == subject
    args = activator_args(docs)
    assert [a for a in args if a.startswith("--namespace")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    # Before extraArgs, which may add more.
    docs = render(
        k8s, "--set", "watchNamespaces={team-a}", "--set", "activator.extraArgs={--host=::}"
    )
    assert activator_args(docs)[-2:] == ["--namespace=team-a", "--host=::"]

    # Namespaced mode: the operator may list the activator Service's EndpointSlices in the
    # release namespace (no Role of its own there); nothing more, and nothing rbac.py lacks.
    docs = render(k8s, "--set", "watchNamespaces={team-a,team-b}")
    role = named(docs, "Role", f"{ACTIVATOR}-endpoints")
    assert role["metadata"]["namespace"] == "batchpilot-system"
    assert expand(role["rules"]) == {("discovery.k8s.io", "endpointslices", "list")}
    assert expand(role["rules"]) <= expand(rbac.RULES)
    binding = named(docs, "RoleBinding", f"{ACTIVATOR}-endpoints")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": FULLNAME, "namespace": "batchpilot-system"}
    ]
    # Not needed where the operator's permissions already cover the release namespace.
    docs = render(k8s, "--set", "watchNamespaces={batchpilot-system,team-a}")
    assert not [d for d in docs if d["metadata"]["name"] == f"{ACTIVATOR}-endpoints"]
    assert sorted(r["metadata"]["namespace"] for r in activator_rbac(docs)["Role"]) == [
        "batchpilot-system",
        "team-a",
    ]
    docs = render(k8s, "--set", "rbac.create=false", "--set", "watchNamespaces={team-a}")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "Role")
    assert named(docs, "Deployment", ACTIVATOR)


def test_activator_admission_policy_binds_the_activator_only(k8s):
    """Rendered by default with the activator: a policy on updates of InferenceServices, its
    matchCondition the activator's user, bound to deny; off with its value or the activator."""
    docs = render(k8s)
    policy = named(docs, "ValidatingAdmissionPolicy", ADMISSION_POLICY)
    binding = named(docs, "ValidatingAdmissionPolicyBinding", ADMISSION_POLICY)
    for obj in (policy, binding):
        assert obj["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "batchpilot-activator"
        assert "namespace" not in obj["metadata"]
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == [GROUP] and rule["operations"] == ["UPDATE"]
    assert PLURAL in rule["resources"]
    user = f"system:serviceaccount:batchpilot-system:{ACTIVATOR}"
    assert [c["expression"] for c in spec["matchConditions"]] == [
        f'request.userInfo.username == "{user}"'
    ]
    # The ServiceAccount it names is the activator pods'.
    pod = named(docs, "Deployment", ACTIVATOR)["spec"]["template"]["spec"]
    assert user == f"system:serviceaccount:batchpilot-system:{pod['serviceAccountName']}"
    assert WAKE_ANNOTATION in spec["variables"][0]["expression"]
    assert binding["spec"] == {"policyName": ADMISSION_POLICY, "validationActions": ["Deny"]}
    for off in ("activator.admissionPolicy.enabled=false", "activator.enabled=false"):
        docs = render(k8s, "--set", off)
        assert not by_kind(docs, "ValidatingAdmissionPolicy"), off
        assert not by_kind(docs, "ValidatingAdmissionPolicyBinding"), off


def test_activator_network_policy(k8s):
    """The activator's pods: ingress to its port from anywhere; egress to batchpilot server
    pods' `http` port in the served namespaces, the API server (443, 6443) and DNS. Each
    variant passes the API server's validation (a server-side dry run)."""
    assert not [d for d in render(k8s) if d["kind"] == "NetworkPolicy"]  # off by default
    docs = render(k8s, "--set", "networkPolicy.enabled=true", "--set", "watchNamespaces={a,b}")
    policy = named(docs, "NetworkPolicy", ACTIVATOR)
    assert policy["metadata"]["namespace"] == "batchpilot-system"
    spec = policy["spec"]
    selector = named(docs, "Deployment", ACTIVATOR)["spec"]["selector"]
    assert spec["podSelector"] == selector
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]  # anywhere
    servers, api_server, dns = spec["egress"]
    server_pods = {"matchLabels": {"app.kubernetes.io/name": "batchpilot-server"}}
    assert servers == {
        "to": [
            {
                "podSelector": server_pods,
                "namespaceSelector": {
                    "matchExpressions": [
                        {
                            "key": "kubernetes.io/metadata.name",
                            "operator": "In",
                            "values": ["a", "b"],
                        }
                    ]
                },
            }
        ],
        "ports": [{"port": "http", "protocol": "TCP"}],
    }
    api_ports = [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]
    assert api_server == {
        "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}],
        "ports": api_ports,
    }
    assert dns == {
        "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}],
        "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
    }  # fmt: skip
    variants = [policy]
    # Every namespace served (the servers' policies where networkPolicy.namespaces says),
    # and the API server's address given.
    for cidr in ("10.0.0.5/32", "fd00:10:96::1/128"):
        docs = render(
            k8s,
            "--set", "networkPolicy.enabled=true",
            "--set", "networkPolicy.namespaces={c}",
            "--set", f"networkPolicy.apiServerCIDR={cidr}",
        )  # fmt: skip
        policy = named(docs, "NetworkPolicy", ACTIVATOR)
        servers, api_server, _ = policy["spec"]["egress"]
        assert servers["to"] == [{"podSelector": server_pods, "namespaceSelector": {}}]
        assert api_server == {"to": [{"ipBlock": {"cidr": cidr}}], "ports": api_ports}
        variants.append(policy)
    for policy in variants:
        policy["metadata"]["namespace"] = "default"
        out = k8s.run_kubectl(
            "create", "--dry-run=server", "--validate=strict", "-f", "-", "-o", "name",
            input=yaml.safe_dump(policy), check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    docs = render(
        k8s, "--set", "networkPolicy.enabled=true", "--set", "watchNamespaces={a}",
        "--set", "activator.enabled=false",
    )  # fmt: skip
    assert [p["metadata"]["name"] for p in by_kind(docs, "NetworkPolicy")] == [
        f"{FULLNAME}-servers"
    ]


@pytest.mark.parametrize(
    ("flag", "needle"),
    [
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("image.tag=latest", "tag"),
        ("watchNamespaces={Not_A_Namespace}", "watchNamespaces"),
        ("operator.logFormat=xml", "logFormat"),
        ("unknownValue=1", "unknownValue"),
        ("activator.port=80", "port"),
        ("activator.maxHeldPerService=0", "maxHeldPerService"),
        ("activator.holdTimeoutSeconds=0", "holdTimeoutSeconds"),
        ("activator.maxBodyBytes=-1", "maxBodyBytes"),
        ("activator.admissionPolicy.enabled=1", "admissionPolicy"),
        ("networkPolicy.apiServerCIDR=10.0.0.5", "apiServerCIDR"),
        ("networkPolicy.apiServerCIDR=kubernetes.default", "apiServerCIDR"),
    ],
)
def test_bad_values_fail_with_a_clear_message(k8s, flag, needle):
    out = helm(k8s, "template", "bp", str(CHART), "--set", flag, check=False)
    assert out.returncode != 0
    assert "values don't meet the specifications of the schema" in out.stderr, out.stderr
    assert needle in out.stderr, out.stderr


def sar(
    k8s,
    user: str,
    verb: str,
    resource: str,
    group: str = "",
    namespace: str = "",
    name: str = "",
    sub: str = "",
) -> bool:
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": [*OPERATOR_SA_GROUPS, f"system:serviceaccounts:{user.split(':')[2]}"],
            "resourceAttributes": {
                "verb": verb,
                "group": group,
                "resource": resource,
                "subresource": sub,
                "namespace": namespace,
                "name": name,
            },
        },
    }
    status, body = k8s.request("/apis/authorization.k8s.io/v1/subjectaccessreviews", "POST", review)
    assert status == 201, body
    return bool(body["status"].get("allowed"))


def leftovers(k8s, release: str, namespaces: list[str]) -> list[str]:
    selector = f"app.kubernetes.io/instance={release}"
    found = []
    out = k8s.run_kubectl(
        "get",
        "clusterroles,clusterrolebindings,validatingadmissionpolicies,"
        "validatingadmissionpolicybindings",
        "-l",
        selector,
        "-o",
        "name",
    ).stdout.split()
    found += out
    for ns in namespaces:
        out = k8s.run_kubectl(
            "get",
            "deployments,replicasets,pods,services,serviceaccounts,configmaps,roles,rolebindings",
            "-n",
            ns,
            "-l",
            selector,
            "-o",
            "name",
        ).stdout.split()
        found += [f"{ns}/{o}" for o in out]
    return found


def check_activator(k8s, namespace: str, fullname: str, watched: str, other: str) -> None:
    """The installed activator: Available (admitted under the restricted standard), told to
    serve the watched namespace, its ServiceAccount may do exactly ACTIVATOR_PERMISSIONS
    there and nothing anywhere else, its admission policy is installed, and the operator
    finds it where BATCHPILOT_ACTIVATOR_SERVICE says, with its own permissions."""
    name = f"{fullname}-activator"
    dep = json.loads(
        k8s.run_kubectl("get", "deployment", name, "-n", namespace, "-o", "json").stdout
    )
    conds = {c["type"]: c["status"] for c in dep["status"].get("conditions", [])}
    assert conds.get("Available") == "True", dep["status"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert [a for a in c["args"] if a.startswith("--namespace")] == [f"--namespace={watched}"]
    user = f"system:serviceaccount:{namespace}:{name}"
    for rule in rbac.ACTIVATOR_PERMISSIONS:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                for verb in rule["verbs"]:
                    assert sar(k8s, user, verb, res, group, watched), (user, verb, res)
                    for ns in ("", other, namespace):  # cluster-wide, elsewhere
                        assert not sar(k8s, user, verb, res, group, ns), (user, verb, res, ns)
    for verb in ("get", "list", "watch", "update", "delete", "create"):
        assert not sar(k8s, user, verb, PLURAL, GROUP, watched), verb
    assert not sar(k8s, user, "patch", PLURAL, GROUP, watched, sub="status")
    assert not sar(k8s, user, "get", "pods", "", watched)
    assert not sar(k8s, user, "create", "pods", "", watched)
    assert not sar(k8s, user, "get", "secrets", "", namespace)
    assert not sar(k8s, user, "list", "endpointslices", "discovery.k8s.io", namespace)
    assert not sar(k8s, user, "patch", "endpointslices", "discovery.k8s.io", watched)
    assert not sar(k8s, user, "patch", "services", "", watched)
    # Its patches are held to the wake annotation by its admission policy.
    policy = json.loads(
        k8s.run_kubectl(
            "get", "validatingadmissionpolicy", f"{name}-wake-only", "-o", "json"
        ).stdout
    )
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == f'request.userInfo.username == "{user}"'
    k8s.run_kubectl("get", "validatingadmissionpolicybinding", f"{name}-wake-only")
    # The operator (watching another namespace) reads the activator's EndpointSlices.
    operator = f"system:serviceaccount:{namespace}:{fullname}"
    assert sar(k8s, operator, "list", "endpointslices", "discovery.k8s.io", namespace)
    (c,) = json.loads(
        k8s.run_kubectl("get", "deployment", fullname, "-n", namespace, "-o", "json").stdout
    )["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    ns, svc = env["BATCHPILOT_ACTIVATOR_SERVICE"].split("/")
    assert (ns, svc) == (namespace, name)

    def found():
        slices = json.loads(
            k8s.run_kubectl(
                "get", "endpointslices", "-n", ns, "-l",
                f"{SLICE_SERVICE_NAME}={svc}", "-o", "json",
            ).stdout
        )["items"]  # fmt: skip
        activator = activator_of(slices)
        return activator if activator and activator.addresses else None

    activator = wait_for("the activator's EndpointSlice", found, timeout=60, interval=0.5)
    assert activator.port == 8000 and len(activator.addresses) == 1, activator


def test_install_rbac_and_uninstall(k8s, namespace):
    """helm install (namespaced mode, watching one other namespace) on the kwok node: the
    operator and activator Deployments become Available; their ServiceAccounts may do exactly
    what they need;
    helm uninstall leaves nothing of the release behind (the CRD stays: Helm keeps crds/)."""
    watched = f"watched-{uuid.uuid4().hex[:6]}"
    other = f"other-{uuid.uuid4().hex[:6]}"
    for ns in (watched, other):
        k8s.run_kubectl("create", "namespace", ns)
    # The operator's pod must be admitted where the restricted standard is enforced.
    k8s.run_kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    release = f"bp-{uuid.uuid4().hex[:6]}"
    try:
        out = helm(
            k8s,
            "install",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--set",
            f"watchNamespaces={{{watched}}}",
            "--set",
            "image.repository=batchpilot-operator",
            "--set",
            "image.tag=cluster-test",
            "--set",
            "autoscaling.keda.enabled=true",
            "--wait",
            "--timeout",
            "180s",
        )
        assert "STATUS: deployed" in out.stdout, out.stdout
        fullname = f"{release}-batchpilot"
        dep = json.loads(
            k8s.run_kubectl("get", "deployment", fullname, "-n", namespace, "-o", "json").stdout
        )
        conds = {c["type"]: c["status"] for c in dep["status"].get("conditions", [])}
        assert conds.get("Available") == "True", dep["status"]
        # The CRD is served (from the chart's crds/ or already present).
        k8s.run_kubectl("get", "crd", f"{PLURAL}.{GROUP}")

        user = f"system:serviceaccount:{namespace}:{fullname}"
        for rule in rbac.RULES:
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    resource, _, sub = res.partition("/")
                    for verb in rule["verbs"]:
                        assert sar(k8s, user, verb, resource, group, watched, sub=sub), (
                            f"{user} may not {verb} {group}/{res} in {watched}"
                        )
        # Denied: anything in a namespace it does not watch, secrets listed, nodes, CRD deletes,
        # and cluster-wide access to the namespaced resources.
        assert not sar(k8s, user, "get", "secrets", "", other)
        # Secrets: create only; nothing that reads or changes an existing one.
        for verb in ("get", "list", "watch", "patch", "update", "delete"):
            assert not sar(k8s, user, verb, "secrets", "", watched), verb
        assert sar(k8s, user, "create", "secrets", "", watched)
        assert not sar(k8s, user, "create", "deployments", "apps", other)
        assert not sar(k8s, user, "list", PLURAL, GROUP, "")
        assert not sar(k8s, user, "list", "nodes")
        assert not sar(k8s, user, "get", "nodes")
        assert not sar(k8s, user, "delete", "customresourcedefinitions", "apiextensions.k8s.io")
        # Deletes of the endpoint picker's Deployment, yes; of a PodDisruptionBudget, no.
        assert sar(k8s, user, "delete", "deployments", "apps", watched)
        assert not sar(k8s, user, "delete", "poddisruptionbudgets", "policy", watched)
        assert not sar(k8s, user, "create", "clusterrolebindings", "rbac.authorization.k8s.io")
        # Roles only with the rights it holds itself: no escalate, no bind.
        for verb in ("escalate", "bind"):
            assert not sar(k8s, user, verb, "roles", "rbac.authorization.k8s.io", watched)
        # An InferenceService in the watched namespace is visible to it.
        assert sar(k8s, user, "watch", PLURAL, GROUP, watched)
        assert VERSION
        check_activator(k8s, namespace, fullname, watched, other)
    finally:
        helm(k8s, "uninstall", release, "--namespace", namespace, "--wait", check=False)
    wait_for(
        "the release's objects to be gone",
        lambda: not leftovers(k8s, release, [namespace, watched]),
        interval=0.5,
    )
    assert helm(k8s, "status", release, "-n", namespace, check=False).returncode != 0
    for ns in (watched, other):
        k8s.run_kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_activator_admission_policy_admits_the_wake_annotation_only(k8s, namespace, api):
    """The rendered policy and binding, and the activator's Role in the namespace it serves,
    on the real API server: acting as the activator's ServiceAccount (impersonated), a merge
    patch that sets only the wake annotation is admitted (annotations absent before, or
    present); one that changes the spec, a label, another annotation, the finalizers or the
    owners is denied by the policy and leaves the object as it was. Nobody else is held to
    it."""
    release = f"bp-{uuid.uuid4().hex[:6]}"
    activator = f"{release}-batchpilot-activator"
    policy = f"{activator}-wake-only"
    user = f"system:serviceaccount:{namespace}:{activator}"
    docs = render(
        k8s, "--set", f"watchNamespaces={{{namespace}}}", release=release, namespace=namespace
    )
    kinds = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "Role", "RoleBinding"}
    objects = [
        d for d in docs if d["kind"] in kinds and d["metadata"]["name"] in (activator, policy)
    ]
    assert sorted(d["kind"] for d in objects) == sorted(kinds)
    api.create("plain", {"replicas": 1})

    def patch(body: dict, *, dry_run: bool = False, as_activator: bool = True) -> str | None:
        """None when admitted, else the API server's answer. The activator's own call: a
        JSON merge patch, never a read first (it may not get InferenceServices)."""
        try:
            api.custom.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, "plain", body,
                dry_run="All" if dry_run else None,
                _content_type="application/merge-patch+json",
                _headers={"Impersonate-User": user} if as_activator else None,
            )  # fmt: skip
        except client.ApiException as e:
            return f"{e.status} {e.body}"
        return None

    def denied(answer: str | None) -> str | None:
        """The policy's message, when it denied the request (not failed to evaluate it)."""
        lead = f"ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request: "
        if answer and lead in answer:
            message = json.loads(answer.partition(" ")[2])["message"].partition(lead)[2]
            return None if "resulted in error" in message else message
        return None

    def annotate(**values) -> dict:
        return {"metadata": {"annotations": values}}

    try:
        for doc in objects:
            k8s.run_kubectl("create", "-f", "-", input=yaml.safe_dump(doc))

        # Enforced once the API server has loaded the policy (and the Role): a forbidden
        # change, as a dry run, is refused by the policy's own check of the labels.
        def labels_refused() -> bool:
            answer = patch({"metadata": {"labels": {"x": "y"}}}, dry_run=True)
            return "labels" in (denied(answer) or "")

        wait_for("the policy to be enforced", labels_refused, timeout=120, interval=0.5)

        # Its expressions type-check against the CRD's schema without a warning.
        def policy_status() -> dict | None:
            out = k8s.run_kubectl("get", "validatingadmissionpolicy", policy, "-o", "json")
            status = json.loads(out.stdout).get("status", {})
            return status if "typeChecking" in status else None

        checked = wait_for("the policy's type check", policy_status)["typeChecking"]
        assert not checked.get("expressionWarnings"), checked
        assert "annotations" not in api.get("plain")["metadata"]
        # The wake annotation alone, on an object without annotations, then changed.
        for stamp in ("2026-01-01T00:00:00.000Z", "2026-01-01T00:00:05.000Z"):
            assert patch(annotate(**{WAKE_ANNOTATION: stamp})) is None
            assert api.get("plain")["metadata"]["annotations"] == {WAKE_ANNOTATION: stamp}
        # Anyone else (here the admin) may change anything: labels, annotations, finalizers.
        assert patch(
            {"metadata": {"labels": {"team": "a"}, "annotations": {"example.com/note": "keep"},
                          "finalizers": ["example.com/hold"]}},
            as_activator=False,
        ) is None  # fmt: skip
        before = api.get("plain")
        owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": str(uuid.uuid4())}
        forbidden = {
            "spec": ({"spec": {"replicas": 3}}, "spec"),
            "spec with the wake": (
                {"spec": {"replicas": 3}, **annotate(**{WAKE_ANNOTATION: "t"})},
                "spec",
            ),
            "a new label": ({"metadata": {"labels": {"other": "x"}}}, "labels"),
            "a label changed": ({"metadata": {"labels": {"team": "b"}}}, "labels"),
            "a label removed": ({"metadata": {"labels": {"team": None}}}, "labels"),
            "a new annotation": (annotate(**{"example.com/other": "x"}), "annotation"),
            "an annotation changed": (annotate(**{"example.com/note": "x"}), "annotation"),
            "an annotation removed": (annotate(**{"example.com/note": None}), "annotation"),
            "every annotation removed": ({"metadata": {"annotations": None}}, "annotation"),
            "the finalizers": ({"metadata": {"finalizers": None}}, "finalizers"),
            "the owners": ({"metadata": {"ownerReferences": [owner]}}, "ownerReferences"),
        }
        for what, (body, word) in forbidden.items():
            answer = patch(body)
            assert answer and answer.startswith("403 "), (what, answer)
            assert word in (denied(answer) or ""), (what, answer)
        after = api.get("plain")
        for key in ("labels", "annotations", "finalizers"):
            assert after["metadata"].get(key) == before["metadata"].get(key), key
        assert "ownerReferences" not in after["metadata"]
        assert after["spec"] == before["spec"]
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        # The wake annotation beside another is admitted, and leaves the other alone.
        assert patch(annotate(**{WAKE_ANNOTATION: "2026-01-01T00:00:10.000Z"})) is None
        assert api.get("plain")["metadata"]["annotations"] == {
            "example.com/note": "keep",
            WAKE_ANNOTATION: "2026-01-01T00:00:10.000Z",
        }
    finally:
        patch({"metadata": {"finalizers": None}}, as_activator=False)
        for doc in objects:
            if "namespace" not in doc["metadata"]:
                k8s.run_kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], check=False)
