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
        self.unserved: set[str] = {"ScaledObject"}  # kinds the API server does not serve (KEDA)

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

    def serves(self, api_version, kind):
        return kind not in self.unserved

    def delete(self, api_version, kind, namespace, name):
        if not self.serves(api_version, kind):
            return False
        self.calls.append(("delete", kind, name))
        return self.objects.pop((kind, namespace, name), None) is not None

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
        ("ConfigMap", "chat-engine"),
        ("Deployment", "chat"),
        ("PodDisruptionBudget", "chat"),
        ("Secret", "chat-admin-token"),
        ("Service", "chat"),
    ]
    applies = [c[1:] for c in kube.calls if c[0] == "apply"]
    # Validated first (dry run), then the Deployment after the Secret and ConfigMap it reads.
    assert applies == [
        ("Deployment", "chat", True),
        ("Secret", "chat-admin-token", False),
        ("ConfigMap", "chat-engine", False),
        ("Service", "chat", False),
        ("PodDisruptionBudget", "chat", False),
        ("Deployment", "chat", False),
    ]
    # No autoscaler asked for: a left-over HPA would go (KEDA's kind is not served here).
    assert [c for c in kube.calls if c[0] == "delete"] == [
        ("delete", "HorizontalPodAutoscaler", "chat")
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
    tuning = {"enabled": True, "allowFP8KVCache": True}
    body = kube.add_isvc("chat", {"tuning": tuning, "engine": {"maxNumSeqs": 32}})
    rec.reconcile(body)
    gen = kube.objects[("Deployment", NS, "chat")]["metadata"]["generation"]
    # A tuned max_num_seqs reaches the ConfigMap new pods read, and the recorded settings,
    # without a rollout.
    kube.objects[("InferenceService", NS, "chat")]["status"]["tuning"] = {"maxNumSeqs": 100}
    rec.reconcile_by_name(NS, "chat")
    dep = kube.objects[("Deployment", NS, "chat")]
    assert dep["metadata"]["generation"] == gen
    assert kube.objects[("ConfigMap", NS, "chat-engine")]["data"] == {"max_num_seqs": "100"}
    assert r.read_engine_settings(dep)["maxNumSeqs"] == 100
    assert kube.status("chat")["engine"]["maxNumSeqs"] == 100
    # An fp8 KV cache rolls the pods.
    kube.objects[("InferenceService", NS, "chat")]["status"]["tuning"]["kvCacheDtype"] = "fp8"
    rec.reconcile_by_name(NS, "chat")
    assert kube.objects[("Deployment", NS, "chat")]["metadata"]["generation"] == gen + 1
    assert kube.status("chat")["engine"]["kvCacheDtype"] == "fp8"


def test_hpa_mode_emits_an_hpa_and_spec_replicas_rule(kube, rec):
    autoscaling = {"enabled": True, "mode": "hpa", "minReplicas": 2, "maxReplicas": 6}
    body = kube.add_isvc("chat", {"autoscaling": autoscaling, "replicas": 3})
    body["status"] = {"autoscaling": {"desiredReplicas": 5}}  # ignored: the HPA decides
    rec.reconcile(body)
    applies = [c[1] for c in kube.calls if c[0] == "apply" and not c[3]]
    assert applies[-2:] == ["Deployment", "HorizontalPodAutoscaler"]
    assert kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 3
    hpa = kube.objects[("HorizontalPodAutoscaler", NS, "chat")]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "InferenceService"
    # Back to the built-in autoscaler: the HPA goes, the loop's decision rules.
    isvc = kube.objects[("InferenceService", NS, "chat")]
    isvc["spec"] = {"autoscaling": {**autoscaling, "mode": "builtin"}, "replicas": 3}
    rec.reconcile_by_name(NS, "chat")
    assert ("HorizontalPodAutoscaler", NS, "chat") not in kube.objects
    assert kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 5


def test_keda_mode_needs_keda(kube, rec):
    keda = {"enabled": True, "mode": "keda", "keda": {"serverAddress": "http://prom:9090"}}
    rec.reconcile(kube.add_isvc("chat", {"autoscaling": keda}))
    assert kube.children() == []
    st = kube.status("chat")
    assert conds(st)["Degraded"] == ("True", "AutoscalerNotServed")
    assert "ScaledObject (keda.sh/v1alpha1)" in st["conditions"][2]["message"]
    kube.unserved.clear()  # KEDA installed: the next round builds everything
    rec.reconcile_by_name(NS, "chat")
    assert ("ScaledObject", "chat") in kube.children()
    assert conds(kube.status("chat"))["Degraded"] == ("False", "AsExpected")


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


# --------------------------------------------------------------------------- the loop timer


def metrics_text(waiting: int, running: int, max_num_seqs: int) -> str:
    """A batchpilot server's /metrics, reduced to what the loop reads."""
    lines = []
    for name, value in (
        ("vllm:num_requests_waiting", waiting),
        ("vllm:num_requests_running", running),
        ("vllm:num_requests_swapped", 0),
        ("vllm:kv_cache_usage_perc", 0.2),
        ("batchpilot:max_num_seqs", max_num_seqs),
    ):
        lines += [f"# TYPE {name} gauge", f'{name}{{model_name="m"}} {value}']
    return "\n".join(lines) + "\n"


class QueuedSource:
    """Two replicas with a long queue: what a real overloaded service reports."""

    async def scrape(self, namespace, name):
        from batchpilot.operator.observe import Scrape

        text = metrics_text(waiting=20, running=8, max_num_seqs=8)
        return [Scrape(f"http://10.0.0.{i}:8000", text=text) for i in (1, 2)]


def test_loop_timer_scales_through_status_and_the_reconcile(kube, rec):
    import asyncio

    from batchpilot.operator.admin_client import AdminClient
    from batchpilot.operator.loop import ClosedLoop
    from batchpilot.operator.loop_timer import LoopTimer

    autoscaling = {"enabled": True, "minReplicas": 2, "maxReplicas": 8, "targetQueueLength": 2,
                   "scaleUpStabilizationSeconds": 0}  # fmt: skip
    rec.reconcile(kube.add_isvc("chat", {"autoscaling": autoscaling}))
    assert kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 2
    now = [1_000_000.0]
    timer = LoopTimer(rec.config, rec, ClosedLoop(QueuedSource(), AdminClient(), lambda: now[0]))
    for _ in range(10):  # rounds, 15 s apart, until the scale-up reaches the Deployment
        asyncio.run(timer.tick(kube.read_isvc(NS, "chat")))
        now[0] += 15
        if kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] > 2:
            break
    st = kube.status("chat")
    replicas = kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"]
    assert replicas > 2 and st["autoscaling"]["desiredReplicas"] == replicas, st
    assert st["metrics"] and st["replicas"] == 0  # the fake API runs no pods
    # Deleted: its samples go (the kopf delete handler calls this).
    assert timer.loop.observer.window(f"{NS}/chat") is not None
    timer.forget(NS, "chat")
    assert timer.loop.observer.window(f"{NS}/chat") is None


def test_loop_timer_leaves_replicas_to_an_hpa(kube, rec):
    import asyncio

    from batchpilot.operator.admin_client import AdminClient
    from batchpilot.operator.loop import ClosedLoop
    from batchpilot.operator.loop_timer import LoopTimer

    autoscaling = {"enabled": True, "mode": "hpa", "scaleUpStabilizationSeconds": 0}
    rec.reconcile(kube.add_isvc("chat", {"autoscaling": autoscaling, "replicas": 2}))
    timer = LoopTimer(rec.config, rec, ClosedLoop(QueuedSource(), AdminClient()))
    for _ in range(3):
        asyncio.run(timer.tick(kube.read_isvc(NS, "chat")))
    assert "autoscaling" not in kube.status("chat")
    assert kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 2
