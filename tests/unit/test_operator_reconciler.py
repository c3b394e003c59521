"""The reconcile shell against an in-memory API: what it applies, in which order, what it
refuses to build, and what status it writes. The real API server is in
tests/integration/test_operator_cluster.py."""

from __future__ import annotations

import copy
import json
import threading

import pytest

from batchpilot.operator import reconcile
from batchpilot.operator.children import secret
from batchpilot.operator.children.engine_args import read_engine_settings
from batchpilot.operator.children.meta import Owner, selector_labels
from batchpilot.operator.children.secret import admin_token
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.kube import ApiException
from batchpilot.operator.reconcile import Reconciler
from tests.support.fake_kube import KEY, NS, FakeKube, QueuedSource, conds


@pytest.fixture
def kube():
    return FakeKube()


@pytest.fixture
def rec(kube):
    # A Deployment's events refresh status at once here (no coalescing): test_operator_api_load
    # has the coalesced refresh.
    config = OperatorConfig(server_image="default/img:1", admin_key=KEY)
    return Reconciler(config, kube=kube, refresh_delay=0)


def secret_name(name: str = "chat") -> str:
    token = admin_token(KEY.encode(), Owner(name=name, namespace=NS, uid=f"uid-{name}"))
    return secret.secret_name(name, token)


def test_builds_all_children_and_writes_status(kube, rec):
    body = kube.add_isvc("chat", {"engine": {"maxNumSeqs": 32}})
    rec.reconcile(body)
    assert kube.children() == [
        ("ConfigMap", "chat-engine"),
        ("Deployment", "chat"),
        ("PodDisruptionBudget", "chat"),
        ("Secret", secret_name()),
        ("Service", "chat"),
    ]
    writes = [c[1:] for c in kube.calls if c[0] in ("apply", "create")]
    # Nothing of those names existed: each is created, never applied over. Validated first
    # (dry run), then the Deployment after the Secret and ConfigMap it reads (those, the
    # Service and the PDB are written together: test_the_writes_before_the_deployment_...).
    assert writes[0] == ("Deployment", "chat", True)
    assert sorted(writes[1:5]) == [
        ("ConfigMap", "chat-engine", False),
        ("PodDisruptionBudget", "chat", False),
        ("Secret", secret_name(), False),
        ("Service", "chat", False),
    ]
    assert writes[5:] == [("Deployment", "chat", False)]
    assert {c[0] for c in kube.calls if c[0] in ("apply", "create")} == {"create"}
    # No autoscaler asked for, and none can be left over from a round that never ran:
    # nothing looked for, nothing deleted.
    assert [c for c in kube.calls if c[0] == "delete"] == []
    assert not [c for c in kube.calls if c[0] == "list" or c[1] == "HorizontalPodAutoscaler"]
    dep = kube.objects[("Deployment", NS, "chat")]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "default/img:1"
    st = kube.status("chat")
    assert st["url"] == "http://chat.team-a.svc.cluster.local:8000"
    assert st["engine"]["maxNumSeqs"] == 32 and st["observedGeneration"] == 1
    assert conds(st)["Degraded"] == ("False", "AsExpected")


def test_reconcile_is_idempotent_and_keeps_the_token(kube, rec):
    body = kube.add_isvc("chat", {})
    rec.reconcile(body)
    secret = copy.deepcopy(kube.objects[("Secret", NS, secret_name())])
    dep = kube.objects[("Deployment", NS, "chat")]["metadata"]["generation"]
    kube.calls.clear()
    rec.reconcile(body)
    assert kube.objects[("Secret", NS, secret_name())] == secret  # never rewritten
    assert kube.objects[("Deployment", NS, "chat")]["metadata"]["generation"] == dep
    # The second round applies over what it checked to be its own.
    writes = {c[:2] for c in kube.calls if c[0] in ("apply", "create") and not c[3]}
    assert ("apply", "Deployment") in writes and ("create", "Secret") in writes
    assert ("status", "chat") not in kube.calls  # nothing changed, nothing written


def test_token_is_derived_never_read(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {}))
    assert not [c for c in kube.calls if c[0] == "read" and c[1] == "Secret"]
    owner = Owner(name="chat", namespace=NS, uid="uid-chat")
    assert rec.admin_token(owner) == admin_token(KEY.encode(), owner)
    # Another operator with the same key derives the same token; another key, another.
    again = Reconciler(OperatorConfig(admin_key=KEY), kube=kube)
    other = Reconciler(OperatorConfig(admin_key="another-key-" + "0" * 32), kube=kube)
    assert again.admin_token(owner) == rec.admin_token(owner) != other.admin_token(owner)


def test_deleted_secret_is_recreated_with_the_same_token_and_nothing_rolls(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {}))
    old = kube.objects.pop(("Secret", NS, secret_name()))
    gen = kube.objects[("Deployment", NS, "chat")]["metadata"]["generation"]
    rec.reconcile_by_name(NS, "chat")
    new = kube.objects[("Secret", NS, secret_name())]
    assert new["data"] == old["data"] and new["immutable"] is True
    assert kube.objects[("Deployment", NS, "chat")]["metadata"]["generation"] == gen


@pytest.mark.parametrize(
    "spec, reason, needle",
    [
        ({"engine": {"maxNumSeqs": 0}}, "InvalidSpec", "spec.engine.maxNumSeqs"),
        ({"engine": {"extraArgs": ["--max-num-seqs", "8"]}}, "InvalidSpec", "--max-num-seqs"),
        ({"model": {"source": "pvc://weights/m"}}, "ModelSourceNotFound", "'weights'"),
        ({"pod": {"serviceAccountName": "ghost"}}, "ServiceAccountNotFound", "'ghost'"),
        ({"pod": {"serviceAccountName": "plain"}}, "ServiceAccountNotAllowed", "'plain'"),
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
    kube.objects[("Deployment", NS, "chat")] = copy.deepcopy(dep)  # the API has what it reports
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


def test_deployment_event_before_an_edit_is_reconciled_keeps_the_observed_generation(
    kube, rec, monkeypatch
):
    """A replica-count event that lands between an edit and its reconcile refreshes the
    replicas but must not mark the edit observed: the reconcile still applies and reports it."""
    rec.reconcile(kube.add_isvc("chat", {}))
    dep = copy.deepcopy(kube.objects[("Deployment", NS, "chat")])
    dep["status"] = {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1}
    kube.objects[("Deployment", NS, "chat")] = copy.deepcopy(dep)
    body = kube.objects[("InferenceService", NS, "chat")]
    body["metadata"]["generation"] = 2
    body["spec"] = {"engine": {"maxNumSeqs": 12}}
    rec.on_deployment_event("MODIFIED", dep)
    st = kube.status("chat")
    assert st["observedGeneration"] == 1 and st["readyReplicas"] == 1
    events = []
    monkeypatch.setattr(reconcile, "post_event", lambda *a: events.append(a))
    rec.reconcile(body)
    assert kube.status("chat")["observedGeneration"] == 2
    assert [e[2] for e in events] == ["Applied"]
    assert "generation 2" in events[0][3]


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
    kube.objects[("InferenceService", NS, "chat")]["status"]["tuning"] = {
        "maxNumSeqs": 100,
        "kvCacheDtype": "auto",
    }
    rec.reconcile_by_name(NS, "chat")
    dep = kube.objects[("Deployment", NS, "chat")]
    assert dep["metadata"]["generation"] == gen
    assert kube.objects[("ConfigMap", NS, "chat-engine")]["data"] == {"max_num_seqs": "100"}
    assert read_engine_settings(dep)["maxNumSeqs"] == 100
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
    writes = [c[1] for c in kube.calls if c[0] in ("apply", "create") and not c[3]]
    assert writes[-2:] == ["Deployment", "HorizontalPodAutoscaler"]
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
    assert kube.objects[("Service", NS, "chat")]["spec"]["selector"] == selector_labels("chat")
    assert [c for c in kube.calls if c[0] == "replace"] == [("replace", "Service", "chat")]


def test_deleted_objects_are_forgotten(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {}))
    rec.reconcile(kube.add_isvc("other", {}))
    assert rec._desired and rec._applied_generation
    svc = kube.objects[("Service", NS, "chat")]
    del kube.objects[("InferenceService", NS, "chat")]
    rec.on_child_event("DELETED", svc)  # the garbage collector's deletions arrive
    assert all(not k[2].startswith("chat") for k in rec._desired)
    assert list(rec._applied_generation) == [(NS, "other")]


# --------------------------------------------------------------------------- the loop timer


def test_loop_timer_scales_through_status_and_the_reconcile(kube, rec):
    import asyncio

    from batchpilot.operator.loop.admin_client import AdminClient
    from batchpilot.operator.loop.timer import LoopTimer
    from batchpilot.operator.loop.turn import ClosedLoop

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

    from batchpilot.operator.loop.admin_client import AdminClient
    from batchpilot.operator.loop.timer import LoopTimer
    from batchpilot.operator.loop.turn import ClosedLoop

    autoscaling = {"enabled": True, "mode": "hpa", "scaleUpStabilizationSeconds": 0}
    rec.reconcile(kube.add_isvc("chat", {"autoscaling": autoscaling, "replicas": 2}))
    timer = LoopTimer(rec.config, rec, ClosedLoop(QueuedSource(), AdminClient()))
    for _ in range(3):
        asyncio.run(timer.tick(kube.read_isvc(NS, "chat")))
    assert "autoscaling" not in kube.status("chat")
    assert kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 2


# --------------------------------------------------------------------------- ownership


def foreign(kind: str, name: str, api_version: str = "v1", **extra) -> dict:
    """An object someone else made, with the name a child of `chat` would have."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": NS, "labels": {"team": "web"}, **extra},
        "spec": {"marker": "theirs"},
    }


@pytest.mark.parametrize(
    "obj",
    [
        foreign("Deployment", "chat", "apps/v1"),
        foreign("Service", "chat"),
        foreign("ConfigMap", "chat-engine"),
        foreign("PodDisruptionBudget", "chat", "policy/v1"),
        # Controlled by another InferenceService of that name (an earlier one: another uid).
        foreign(
            "Service",
            "chat",
            ownerReferences=[
                {
                    "apiVersion": "batchpilot.dev/v1alpha1",
                    "kind": "InferenceService",
                    "name": "chat",
                    "uid": "uid-of-an-earlier-chat",
                    "controller": True,
                }
            ],
        ),
    ],
    ids=["deployment", "service", "configmap", "pdb", "earlier-owner"],
)
def test_a_name_taken_by_someone_else_is_left_untouched_and_degrades(kube, rec, obj):
    live = kube.put(obj)
    rec.reconcile(kube.add_isvc("chat", {}))
    key = (obj["kind"], NS, obj["metadata"]["name"])
    assert kube.objects[key] == live  # not a field changed, same resourceVersion
    assert kube.children() == [(obj["kind"], obj["metadata"]["name"])]  # nothing else built
    assert not [c for c in kube.calls if c[0] in ("apply", "create", "replace", "delete")]
    st = kube.status("chat")
    assert conds(st)["Degraded"] == ("True", "NameConflict")
    message = st["conditions"][2]["message"]
    assert f"{obj['kind']} {obj['metadata']['name']!r} exists" in message
    assert "left untouched" in message
    # Status never describes someone else's Deployment.
    assert st["replicas"] == 0 and "engine" not in st
    # Once it is gone, the next round builds everything.
    del kube.objects[key]
    rec.reconcile_by_name(NS, "chat")
    assert conds(kube.status("chat"))["Degraded"] == ("False", "AsExpected")
    assert len(kube.children()) == 5


def test_an_hpa_of_the_name_is_ours_to_replace_only_if_we_own_it(kube, rec):
    """mode hpa: a foreign HPA of the name is a conflict. Otherwise it is not a child at all:
    it is left alone, never deleted as a left-over of an earlier spec."""
    hpa = kube.put(foreign("HorizontalPodAutoscaler", "chat", "autoscaling/v2"))
    autoscaling = {"enabled": True, "mode": "hpa"}
    rec.reconcile(kube.add_isvc("chat", {"autoscaling": autoscaling}))
    assert conds(kube.status("chat"))["Degraded"] == ("True", "NameConflict")
    assert kube.objects[("HorizontalPodAutoscaler", NS, "chat")] == hpa
    isvc = kube.objects[("InferenceService", NS, "chat")]
    isvc["spec"], isvc["metadata"]["generation"] = {}, 2
    rec.reconcile_by_name(NS, "chat")
    assert conds(kube.status("chat"))["Degraded"] == ("False", "AsExpected")
    assert kube.objects[("HorizontalPodAutoscaler", NS, "chat")] == hpa
    assert ("delete", "HorizontalPodAutoscaler", "chat") not in kube.calls


def test_a_left_over_hpa_of_ours_is_deleted_exactly_as_checked(kube, rec):
    autoscaling = {"enabled": True, "mode": "hpa"}
    rec.reconcile(kube.add_isvc("chat", {"autoscaling": autoscaling}))
    hpa = kube.objects[("HorizontalPodAutoscaler", NS, "chat")]
    isvc = kube.objects[("InferenceService", NS, "chat")]
    isvc["spec"], isvc["metadata"]["generation"] = {}, 2
    rec.reconcile_by_name(NS, "chat")
    assert ("HorizontalPodAutoscaler", NS, "chat") not in kube.objects
    assert ("delete", "HorizontalPodAutoscaler", "chat") in kube.calls
    assert hpa["metadata"]["uid"]  # the precondition the fake checked


def test_the_first_build_skips_the_stale_checks_and_later_rounds_make_them(kube, rec):
    """A service never reconciled, with no child of its names: no earlier round can have
    left an optional child, so the first build reads no optional kind and lists nothing
    (three requests fewer per service at 1,000 services). Any later round checks."""
    body = kube.add_isvc("chat", {})
    rec.reconcile(body)
    reads = sorted(c for c in kube.calls if c[0] in ("read", "list"))
    assert reads == [("read", k, n) for k, n in [
        ("ConfigMap", "chat-engine"), ("Deployment", "chat"), ("PodDisruptionBudget", "chat"),
        ("Service", "chat"),
    ]]  # fmt: skip
    kube.calls.clear()
    rec.reconcile(body)
    assert ("read", "HorizontalPodAutoscaler", "chat") in kube.calls
    assert [c[:2] for c in kube.calls if c[0] == "list"] == [("list", "Deployment")]


def test_the_ownership_checks_read_the_children_at_once():
    """The four reads of a build's checks are in flight together (each waits here for the
    other three): one API server round trip, not four, before the first write."""

    class Together(FakeKube):
        met = threading.Barrier(4, timeout=5)

        def read(self, api_version, kind, namespace, name):
            if kind in ("ConfigMap", "Service", "PodDisruptionBudget", "Deployment"):
                self.met.wait()
            return super().read(api_version, kind, namespace, name)

    kube = Together()
    Reconciler(OperatorConfig(admin_key=KEY), kube=kube).reconcile(kube.add_isvc("chat", {}))
    assert conds(kube.status("chat"))["Degraded"] == ("False", "AsExpected")
    assert len(kube.children()) == 5


def test_the_writes_before_the_deployment_are_in_flight_together():
    """The Secret, ConfigMap, Service and PDB of a build are written at once (each waits
    here for the other three), and the Deployment only after all four: one round trip
    for them, not four, and the pods never start before what they read."""

    class Together(FakeKube):
        met = threading.Barrier(4, timeout=5)

        def create(self, obj, *, dry_run=False):
            if obj["kind"] == "Deployment" and not dry_run:
                made = {kind for kind, _, _ in self.objects}
                assert {"Secret", "ConfigMap", "Service", "PodDisruptionBudget"} <= made
            elif not dry_run:
                self.met.wait()
            return super().create(obj, dry_run=dry_run)

    kube = Together()
    Reconciler(OperatorConfig(admin_key=KEY), kube=kube).reconcile(kube.add_isvc("chat", {}))
    assert conds(kube.status("chat"))["Degraded"] == ("False", "AsExpected")
    assert len(kube.children()) == 5


def test_a_left_over_child_is_deleted_when_an_earlier_round_stopped_before_its_status(kube):
    """A round that built the children but died before writing status (an operator
    restart): the next finds children, so it still looks for stale ones and deletes its own
    left-over HPA (the spec no longer asks for one)."""
    first = Reconciler(OperatorConfig(admin_key=KEY), kube=kube)
    first.reconcile(kube.add_isvc("chat", {"autoscaling": {"enabled": True, "mode": "hpa"}}))
    assert ("HorizontalPodAutoscaler", NS, "chat") in kube.objects
    isvc = kube.objects[("InferenceService", NS, "chat")]
    isvc["spec"], isvc["metadata"]["generation"] = {}, 2
    del isvc["status"]  # as if the status write never happened
    Reconciler(OperatorConfig(admin_key=KEY), kube=kube).reconcile_by_name(NS, "chat")
    assert ("HorizontalPodAutoscaler", NS, "chat") not in kube.objects
    assert ("delete", "HorizontalPodAutoscaler", "chat") in kube.calls


def test_a_child_made_by_someone_else_between_the_check_and_the_write_is_not_taken(kube, rec):
    """The check and the write are not one call: a create fails on an object made since it
    was found absent, and an apply on one changed since it was checked (409: kopf retries,
    and the next round sees whose it is)."""

    class Racing(FakeKube):
        def create(self, obj, *, dry_run=False):
            if obj["kind"] == "Service" and not dry_run:
                self.put(foreign("Service", "chat"))  # someone is faster
            return super().create(obj, dry_run=dry_run)

    kube = Racing()
    rec = Reconciler(OperatorConfig(admin_key=KEY), kube=kube)
    with pytest.raises(ApiException) as e:
        rec.reconcile(kube.add_isvc("chat", {}))
    assert e.value.status == 409
    assert kube.objects[("Service", NS, "chat")]["spec"] == {"marker": "theirs"}
    rec.reconcile_by_name(NS, "chat")  # kopf's retry
    assert conds(kube.status("chat"))["Degraded"] == ("True", "NameConflict")


def test_a_late_deployment_event_does_not_take_the_status_back(kube, rec):
    """An event handled after a newer state was written (a busy operator) reads the
    Deployment as it is now: Ready and the counts do not go back to the event's."""
    rec.reconcile(kube.add_isvc("chat", {}))
    ready = {"observedGeneration": 1, "replicas": 3, "updatedReplicas": 3, "readyReplicas": 3,
             "availableReplicas": 3}  # fmt: skip
    kube.objects[("Deployment", NS, "chat")]["status"] = ready
    old = copy.deepcopy(kube.objects[("Deployment", NS, "chat")])
    old["status"] = {"observedGeneration": 1, "replicas": 1}
    rec.on_deployment_event("MODIFIED", old)
    st = kube.status("chat")
    assert (st["replicas"], st["readyReplicas"]) == (3, 3)
    assert conds(st)["Ready"][0] == "True"


def test_deployment_events_of_an_earlier_object_are_ignored(kube, rec):
    rec.reconcile(kube.add_isvc("chat", {}))
    dep = copy.deepcopy(kube.objects[("Deployment", NS, "chat")])
    dep["metadata"]["ownerReferences"][0]["uid"] = "uid-of-an-earlier-chat"
    dep["status"] = {"replicas": 7, "readyReplicas": 7}
    rec.on_deployment_event("MODIFIED", dep)
    assert kube.status("chat")["replicas"] == 0


def test_a_status_update_between_the_check_and_the_apply_is_not_a_failure(kube, rec):
    """A Deployment's controller writes its status all the time, which moves its
    resourceVersion: the pinned apply fails once with 409, the child is checked again and
    applied at its new version."""
    rec.reconcile(kube.add_isvc("chat", {}))

    class Busy(FakeKube):
        bumped = False

        def apply(self, obj, *, dry_run=False):
            if obj["kind"] == "Deployment" and not dry_run and not self.bumped:
                self.bumped = True
                self.put(self.objects[("Deployment", NS, "chat")])  # a new resourceVersion
            return super().apply(obj, dry_run=dry_run)

    busy = Busy()
    busy.objects = kube.objects
    isvc = busy.objects[("InferenceService", NS, "chat")]
    isvc["spec"], isvc["metadata"]["generation"] = {"engine": {"maxNumSeqs": 9}}, 2
    Reconciler(rec.config, kube=busy).reconcile_by_name(NS, "chat")
    assert busy.bumped
    assert busy.status("chat")["engine"]["maxNumSeqs"] == 9
    assert [c[:2] for c in busy.calls if c[:2] == ("apply", "Deployment") and not c[3]] == [
        ("apply", "Deployment")
    ] * 2
