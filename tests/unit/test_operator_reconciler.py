"""The reconcile shell against an in-memory API: what it applies, in which order, what it
refuses to build, and what status it writes. The real API server is in
tests/integration/test_operator_cluster.py."""

from __future__ import annotations

import base64
import copy
import json

import pytest

from batchpilot.operator import resources as r
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.handlers import Reconciler
from batchpilot.operator.kube import ApiException

NS = "team-a"


class FakeKube:
    field_manager = "batchpilot-operator"

    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.calls: list[tuple] = []
        self.pvcs: set[str] = set()
        self.service_accounts: set[str] = {"default"}
        self.reject: dict[str, ApiException] = {}  # kind -> error on (dry-run) apply

    def add_isvc(self, name: str, spec: dict, generation: int = 1) -> dict:
        body = {
            "apiVersion": "batchpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {
                "name": name,
                "namespace": NS,
                "uid": f"uid-{name}",
                "generation": generation,
            },
            "spec": spec,
        }
        self.objects[("InferenceService", NS, name)] = body
        return body

    def apply(self, obj: dict, *, dry_run: bool = False) -> dict:
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"], dry_run))
        if obj["kind"] in self.reject:
            raise self.reject[obj["kind"]]
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        old = self.objects.get(key)
        new = copy.deepcopy(obj)
        if old is not None and "managedFields" in old["metadata"]:  # others' entries stay
            new["metadata"]["managedFields"] = old["metadata"]["managedFields"]
        gen = (old or {}).get("metadata", {}).get("generation", 0)
        changed = old is None or old.get("spec") != obj.get("spec")
        new["metadata"]["generation"] = gen + 1 if changed else gen
        if not dry_run:
            self.objects[key] = new
        return copy.deepcopy(new)

    def replace(self, obj: dict) -> dict:
        self.calls.append(("replace", obj["kind"], obj["metadata"]["name"]))
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.objects[key] = copy.deepcopy(obj)
        return copy.deepcopy(obj)

    def read(self, api_version, kind, namespace, name):
        self.calls.append(("read", kind, name))
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def read_isvc(self, namespace, name):
        return copy.deepcopy(self.objects.get(("InferenceService", namespace, name)))

    def patch_isvc_status(self, namespace, name, status):
        self.calls.append(("status", name))
        body = self.objects[("InferenceService", namespace, name)]
        body["status"] = {**body.get("status", {}), **copy.deepcopy(status)}

    def pvc_exists(self, namespace, name):
        return name in self.pvcs

    def service_account_exists(self, namespace, name):
        return name in self.service_accounts

    def children(self) -> list[tuple[str, str]]:
        return sorted((k, n) for (k, _, n) in self.objects if k != "InferenceService")

    def status(self, name: str) -> dict:
        return self.objects[("InferenceService", NS, name)].get("status", {})


def conds(st: dict) -> dict:
    return {c["type"]: (c["status"], c["reason"]) for c in st.get("conditions", [])}


@pytest.fixture
def kube():
    return FakeKube()


@pytest.fixture
def rec(kube):
    return Reconciler(OperatorConfig(server_image="default/img:1"), kube=kube)


def test_builds_all_children_and_writes_status(kube, rec):
    body = kube.add_isvc("chat", {"engine": {"maxNumSeqs": 32}})
    rec.reconcile(body)
    assert kube.children() == [
        ("Deployment", "chat"),
        ("PodDisruptionBudget", "chat"),
        ("Secret", "chat-admin-token"),
        ("Service", "chat"),
    ]
    applies = [c[1:] for c in kube.calls if c[0] == "apply"]
    # Validated first (dry run), then the Deployment last, after the Secret it reads.
    assert applies == [
        ("Deployment", "chat", True),
        ("Secret", "chat-admin-token", False),
        ("Service", "chat", False),
        ("PodDisruptionBudget", "chat", False),
        ("Deployment", "chat", False),
    ]
    dep = kube.objects[("Deployment", NS, "chat")]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "default/img:1"
    st = kube.status("chat")
    assert st["url"] == "http://chat.team-a.svc.cluster.local:8000"
    assert st["engine"]["maxNumSeqs"] == 32 and st["observedGeneration"] == 1
    assert conds(st)["Degraded"] == ("False", "AsExpected")


def test_reconcile_is_idempotent_and_keeps_the_token(kube, rec):
    body = kube.add_isvc("chat", {})
    rec.reconcile(body)
    token = kube.objects[("Secret", NS, "chat-admin-token")]["data"]["token"]
    dep = copy.deepcopy(kube.objects[("Deployment", NS, "chat")])
    kube.calls.clear()
    rec.reconcile(body)
    assert kube.objects[("Secret", NS, "chat-admin-token")]["data"]["token"] == token
    assert kube.objects[("Deployment", NS, "chat")] == dep  # same generation: no rollout
    assert ("status", "chat") not in kube.calls  # nothing changed, nothing written


def test_deleted_secret_gets_a_new_token_and_the_pods_roll(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {}))
    old = kube.objects.pop(("Secret", NS, "chat-admin-token"))
    gen = kube.objects[("Deployment", NS, "chat")]["metadata"]["generation"]
    rec.reconcile_by_name(NS, "chat")
    new = kube.objects[("Secret", NS, "chat-admin-token")]
    assert new["data"]["token"] != old["data"]["token"]
    assert base64.b64decode(new["data"]["token"])
    assert kube.objects[("Deployment", NS, "chat")]["metadata"]["generation"] == gen + 1


@pytest.mark.parametrize(
    "spec, reason, needle",
    [
        ({"engine": {"maxNumSeqs": 0}}, "InvalidSpec", "spec.engine.maxNumSeqs"),
        ({"engine": {"extraArgs": ["--max-num-seqs", "8"]}}, "InvalidSpec", "--max-num-seqs"),
        ({"model": {"source": "pvc://weights/m"}}, "ModelSourceNotFound", "'weights'"),
        ({"pod": {"serviceAccountName": "ghost"}}, "ServiceAccountNotFound", "'ghost'"),
    ],
)
def test_bad_specs_build_nothing_and_degrade(kube, rec, spec, reason, needle):
    rec.reconcile(kube.add_isvc("chat", spec))
    assert kube.children() == []
    st = kube.status("chat")
    assert conds(st) == {
        "Ready": ("False", reason),
        "Progressing": ("False", reason),
        "Degraded": ("True", reason),
    }
    assert needle in st["conditions"][2]["message"]


def test_api_server_rejection_of_the_deployment_builds_nothing(kube, rec):
    body = json.dumps({"message": 'Deployment.apps "chat" is invalid: affinity: bad'})
    kube.reject["Deployment"] = ApiException(status=422, reason="Unprocessable Entity")
    kube.reject["Deployment"].body = body
    rec.reconcile(kube.add_isvc("chat", {"pod": {"affinity": {"nodeAffinity": {"x": 1}}}}))
    assert kube.children() == []
    st = kube.status("chat")
    assert conds(st)["Degraded"] == ("True", "InvalidSpec")
    assert "affinity: bad" in st["conditions"][2]["message"]


def test_transient_api_errors_propagate_for_kopf_to_retry(kube, rec):
    kube.reject["Service"] = ApiException(status=503, reason="Service Unavailable")
    with pytest.raises(ApiException):
        rec.reconcile(kube.add_isvc("chat", {}))


def test_bad_update_keeps_the_running_deployment(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {"engine": {"maxNumSeqs": 32}}))
    dep = copy.deepcopy(kube.objects[("Deployment", NS, "chat")])
    isvc = kube.objects[("InferenceService", NS, "chat")]
    isvc["spec"] = {"engine": {"maxNumSeqs": 32, "extraArgs": ["--port=1"]}}
    isvc["metadata"]["generation"] = 2
    rec.reconcile_by_name(NS, "chat")
    assert kube.objects[("Deployment", NS, "chat")] == dep
    st = kube.status("chat")
    assert conds(st)["Degraded"] == ("True", "InvalidSpec")
    assert st["engine"]["maxNumSeqs"] == 32 and st["observedGeneration"] == 2
    # Fixing the spec recovers.
    isvc["spec"] = {"engine": {"maxNumSeqs": 40}}
    isvc["metadata"]["generation"] = 3
    rec.reconcile_by_name(NS, "chat")
    st = kube.status("chat")
    assert conds(st)["Degraded"] == ("False", "AsExpected")
    assert st["engine"]["maxNumSeqs"] == 40


def test_missing_pvc_converges_once_it_exists(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {"model": {"source": "pvc://weights/m"}}))
    assert kube.children() == []
    kube.pvcs.add("weights")
    rec.reconcile_by_name(NS, "chat")  # the timer's next round
    assert ("Deployment", "chat") in kube.children()
    assert conds(kube.status("chat"))["Degraded"] == ("False", "AsExpected")


def test_deployment_events(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {}))
    dep = copy.deepcopy(kube.objects[("Deployment", NS, "chat")])
    dep["status"] = {
        "observedGeneration": 1,
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 1,
        "availableReplicas": 1,
    }
    kube.calls.clear()
    rec.on_deployment_event("MODIFIED", dep)
    assert [c for c in kube.calls if c[0] == "apply"] == []  # a status change: no re-apply
    assert conds(kube.status("chat"))["Ready"] == ("True", "MinimumReplicasReady")
    # Edited by hand (a new generation): restored by a full reconcile.
    edited = copy.deepcopy(dep)
    edited["metadata"]["generation"] = 2
    kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] = 5
    rec.on_deployment_event("MODIFIED", edited)
    assert kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 1
    # Deleted: recreated.
    del kube.objects[("Deployment", NS, "chat")]
    rec.on_deployment_event("DELETED", dep)
    assert ("Deployment", "chat") in kube.children()
    # Not ours: ignored.
    kube.calls.clear()
    rec.on_deployment_event(
        "DELETED", {**dep, "metadata": {**dep["metadata"], "ownerReferences": []}}
    )
    assert kube.calls == []


def test_child_events(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {}))
    svc = copy.deepcopy(kube.objects[("Service", NS, "chat")])
    kube.calls.clear()
    rec.on_child_event("MODIFIED", {**svc, "status": {"loadBalancer": {}}})
    assert kube.calls == []  # nothing of ours changed
    del kube.objects[("Service", NS, "chat")]
    rec.on_child_event("DELETED", svc)
    assert ("Service", "chat") in kube.children()


def test_deleting_objects_are_left_alone(kube, rec):
    body = kube.add_isvc("chat", {})
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    rec.reconcile(body)
    assert kube.children() == [] and kube.calls == []


def test_loop_decisions_in_status_reach_the_deployment(kube, rec):
    body = kube.add_isvc("chat", {"tuning": {"enabled": True}, "engine": {"maxNumSeqs": 32}})
    body["status"] = {"tuning": {"maxNumSeqs": 100}}
    rec.reconcile(body)
    assert r.read_engine_settings(kube.objects[("Deployment", NS, "chat")])["maxNumSeqs"] == 100
    assert kube.status("chat")["engine"]["maxNumSeqs"] == 100


def test_fields_added_by_others_are_dropped(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {}))
    svc = kube.objects[("Service", NS, "chat")]
    svc["spec"]["selector"]["app"] = "hijacked"
    svc["metadata"]["managedFields"] = [
        {"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:spec": {}}},
        {
            "manager": "kube-controller-manager",
            "subresource": "status",
            "fieldsV1": {"f:status": {}},
        },
    ]
    kube.calls.clear()
    rec.reconcile_by_name(NS, "chat")
    assert ("replace", "Service", "chat") in kube.calls
    assert kube.objects[("Service", NS, "chat")]["spec"]["selector"] == r.selector_labels("chat")
    assert [c for c in kube.calls if c[0] == "replace"] == [("replace", "Service", "chat")]


def test_deleted_objects_are_forgotten(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {}))
    rec.reconcile(kube.add_isvc("other", {}))
    assert rec._desired and rec._applied_generation
    svc = kube.objects[("Service", NS, "chat")]
    del kube.objects[("InferenceService", NS, "chat")]
    rec.on_child_event("DELETED", svc)  # the garbage collector's deletions arrive
    assert all(k[2] != "chat" and k[2] != "chat-admin-token" for k in rec._desired)
    assert list(rec._applied_generation) == [(NS, "other")]
