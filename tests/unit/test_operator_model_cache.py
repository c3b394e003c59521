"""The model cache (spec.model.cache): its schema, the pure builders (the claim, the fill
Job, the read-only mount), the state from the Job and the conditions, and the reconcile
shell against the in-memory API: no pods until the fill Job has succeeded. The real API
server is in tests/integration/test_operator_model_cache_cluster.py."""

from __future__ import annotations

import pytest

from batchpilot.operator import status
from batchpilot.operator.children.build import build_children
from batchpilot.operator.children.cache import (
    build_cache_claim,
    build_fill_job,
    fill_job_name,
)
from batchpilot.operator.children.meta import Owner, selector_labels
from batchpilot.operator.children.plan import cache_key, plan_model
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.crd.spec import SpecError, parse_spec
from batchpilot.operator.model_cache import job_state, settled
from batchpilot.operator.reconcile import Reconciler
from tests.support.fake_kube import KEY, NS, FakeKube, conds

IMAGE = "registry.example/batchpilot-server:1"
OWNER = Owner(name="chat", namespace=NS, uid="uid-chat")
CACHED = {"model": {"cache": {"claimName": "models"}}}


def spec(**model) -> object:
    return parse_spec({"model": {"cache": {"claimName": "models"}, **model}})


# ------------------------------------------------------------------ schema and plan


def test_the_cache_defaults_and_bounds():
    """The size's quantity pattern is the API server's to check (as for pod resources):
    the cluster test sends it one."""
    cache = spec().model.cache
    assert (cache.claim_name, cache.size, cache.access_modes) == (
        "models",
        "10Gi",
        ["ReadWriteMany"],
    )
    assert cache.storage_class_name is None
    for bad in (
        {"claimName": "Models"},
        {"claimName": "m" * 64},
        {"claimName": "m", "accessModes": ["ReadWriteOncePod"]},
        {"claimName": "m", "accessModes": []},
        {"claimName": "m", "extra": 1},
    ):
        with pytest.raises(SpecError):
            parse_spec({"model": {"cache": bad}})


def test_a_pvc_source_is_not_cached():
    with pytest.raises(SpecError, match="pvc:// source is on a claim already"):
        spec(source="pvc://weights/m")


def test_the_key_is_readable_and_changes_with_source_and_image():
    key = cache_key("bundled", IMAGE)
    assert key.startswith("smollm2-135m-instruct-") and key == cache_key("bundled", IMAGE)
    assert cache_key("/opt/Qwen2_0.5B.gguf", IMAGE).startswith("qwen2-0.5b-")
    others = {cache_key("bundled", IMAGE + "x"), cache_key("hf://org/m", IMAGE), key}
    assert len(others) == 3


def test_the_server_loads_from_the_cache_under_the_source_name():
    plan = plan_model(spec(source="hf://org/Chat-7B"), IMAGE)
    assert plan.arg == f"/models/models/{cache_key('hf://org/Chat-7B', IMAGE)}"
    assert (plan.served_name, plan.pvc) == ("Chat-7B", "models")
    assert plan_model(spec(), IMAGE).served_name == "smollm2-135m-instruct"


# ------------------------------------------------------------------ builders


def test_the_claim_is_labelled_not_owned():
    claim = build_cache_claim(
        OWNER,
        spec(cache={"claimName": "c", "size": "20Gi", "storageClassName": "nfs",
                    "accessModes": ["ReadWriteOnce"]}),
    )  # fmt: skip
    meta = claim["metadata"]
    assert meta["name"] == "c" and "ownerReferences" not in meta  # outlives the service
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "batchpilot-operator"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "20Gi"}},
        "storageClassName": "nfs",
    }


def test_the_fill_job_writes_the_claim_and_is_never_a_serving_pod():
    s = parse_spec(
        {
            **CACHED,
            "resources": {"limits": {"cpu": 2, "memory": "4Gi", "nvidia.com/gpu": 1}},
            "pod": {
                "volumes": [{"name": "src", "emptyDir": {}}],
                "volumeMounts": [{"name": "src", "mountPath": "/src"}],
            },
        }
    )
    job = build_fill_job(OWNER, s, IMAGE)
    path = f"/models/models/{cache_key('bundled', IMAGE)}"
    assert job["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert len(job["metadata"]["name"]) <= 63
    pod = job["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert not selector_labels("chat").items() <= labels.items()
    (c,) = pod["spec"]["containers"]
    assert c["image"] == IMAGE
    assert c["command"] + c["args"] == [
        "batchpilot", "model", "cache", "--source", "bundled", "--output", path
    ]  # fmt: skip
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models/models"].get("readOnly") is None  # read-write
    assert mounts["/src"]["readOnly"] is True
    assert c["resources"] == {"limits": {"cpu": "2", "memory": "4Gi"}}  # no GPU
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["automountServiceAccountToken"] is False
    claims = [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}]


def test_fill_job_names_fit_a_label_for_the_longest_service_name():
    owner = Owner(name="a" * 63, namespace=NS, uid="u")
    assert len(fill_job_name(owner, "/models/m/k")) <= 63
    assert fill_job_name(owner, "/models/m/k") != fill_job_name(owner, "/models/m/j")


def test_the_replicas_mount_the_claim_read_only_and_load_the_cached_path():
    children = build_children(OWNER, spec(), image=IMAGE, admin_token="t" * 43)
    (dep,) = [c for c in children if c["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    assert args[args.index("--model") + 1] == f"/models/models/{cache_key('bundled', IMAGE)}"
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/models/models"]
    assert mount["readOnly"] is True
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


# ------------------------------------------------------------------ state and conditions


def job(*conditions: tuple[str, str, str]) -> dict:
    return {
        "metadata": {"name": "chat-cache-1"},
        "status": {
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": m} for t, r, m in conditions
            ]
        },
    }


def test_the_state_follows_the_job():
    running = job_state(job(), {"metadata": {"name": "c"}, "status": {"phase": "Bound"}}, "/p")
    assert (running.ready, running.reason) == (False, status.CACHE_FILLING)
    pending = job_state(job(), {"metadata": {"name": "c"}, "status": {"phase": "Pending"}}, "/p")
    assert "'c' (Pending)" in pending.message
    done = job_state(job(("SuccessCriteriaMet", "", ""), ("Complete", "", "")), None, "/p")
    assert (done.ready, done.reason) == (True, status.CACHE_FILLED)
    failed = job_state(job(("Failed", "BackoffLimitExceeded", "has reached the limit")), None, "/p")
    assert (failed.ready, failed.reason) == (False, status.CACHE_FAILED)
    assert "BackoffLimitExceeded: has reached the limit" in failed.message


def test_only_finished_or_deleted_jobs_wake_the_reconcile():
    assert settled("DELETED", job())
    assert settled("MODIFIED", job(("Complete", "", "")))
    assert settled("MODIFIED", job(("Failed", "DeadlineExceeded", "")))
    assert not settled("MODIFIED", job())
    assert not settled(None, job(("Complete", "", "")))  # the listing at start


def test_conditions_while_filling_then_filled():
    filling = status.CacheState(False, status.CACHE_FILLING, "Job j is filling /p")
    st = status.compute_status(
        name="chat", generation=1, prev={}, deployment=None, problem=None, url=None,
        cache=filling,
    )  # fmt: skip
    assert conds(st)["Ready"] == ("False", status.MODEL_CACHE_FILLING)
    assert conds(st)["Progressing"] == ("True", status.MODEL_CACHE_FILLING)
    assert conds(st)["Degraded"] == ("False", "AsExpected")
    assert conds(st)["ModelCacheReady"] == ("False", "Filling")
    assert status.kept_cache(st) == filling
    filled = status.CacheState(True, status.CACHE_FILLED, "/p filled")
    new = status.compute_status(
        name="chat", generation=1, prev=st, deployment=None, problem=None, url=None,
        cache=filled,
    )  # fmt: skip
    assert conds(new)["ModelCacheReady"] == ("True", "Filled")
    assert status.newly_applied(st, new)  # the generation that waited posts its Applied
    assert not status.newly_applied(new, new)


# ------------------------------------------------------------------ the reconcile shell


@pytest.fixture
def kube():
    return FakeKube()


@pytest.fixture
def rec(kube):
    return Reconciler(OperatorConfig(server_image=IMAGE, admin_key=KEY), kube=kube)


def fill_job(kube: FakeKube) -> dict:
    (found,) = [o for (k, _, _), o in kube.objects.items() if k == "Job"]
    return found


def finish(kube: FakeKube, type_: str, reason: str = "") -> None:
    done = fill_job(kube)
    done["status"] = {"conditions": [{"type": type_, "status": "True", "reason": reason}]}


def test_no_pods_until_the_fill_job_succeeds(kube, rec):
    body = kube.add_isvc("chat", CACHED)
    rec.reconcile(body)
    assert {k for k, _ in kube.children()} == {"PersistentVolumeClaim", "Job"}
    st = kube.status("chat")
    assert conds(st)["ModelCacheReady"] == ("False", "Filling")
    assert conds(st)["Ready"] == ("False", status.MODEL_CACHE_FILLING)

    finish(kube, "Complete")
    rec.reconcile(body)
    dep = kube.objects[("Deployment", NS, "chat")]
    (mount,) = [
        m
        for m in dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        if m["mountPath"] == "/models/models"
    ]
    assert mount["readOnly"] is True
    assert conds(kube.status("chat"))["ModelCacheReady"] == ("True", "Filled")


def test_a_claim_that_exists_is_used_as_it_is(kube, rec):
    theirs = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
              "metadata": {"name": "models", "namespace": NS}, "spec": {"x": 1}}  # fmt: skip
    kube.put(theirs)
    before = kube.objects[("PersistentVolumeClaim", NS, "models")]
    rec.reconcile(kube.add_isvc("chat", CACHED))
    assert kube.objects[("PersistentVolumeClaim", NS, "models")] == before
    writes = [c for c in kube.calls if c[0] in ("create", "apply", "replace", "delete")]
    assert all(c[1] != "PersistentVolumeClaim" for c in writes), writes


def test_a_failed_fill_is_degraded_and_keeps_any_serving_deployment_away(kube, rec):
    body = kube.add_isvc("chat", CACHED)
    rec.reconcile(body)
    finish(kube, "Failed", "BackoffLimitExceeded")
    rec.reconcile(body)
    st = kube.status("chat")
    assert conds(st)["Degraded"] == ("True", status.MODEL_CACHE_FAILED)
    assert conds(st)["ModelCacheReady"] == ("False", "Failed")
    assert "BackoffLimitExceeded" in status.find_condition(st, "Degraded")["message"]
    assert ("Deployment", "chat") not in kube.children()


def test_a_new_source_waits_for_its_fill_and_drops_the_old_job(kube, rec):
    body = kube.add_isvc("chat", CACHED)
    rec.reconcile(body)
    finish(kube, "Complete")
    rec.reconcile(body)
    old_job = fill_job(kube)["metadata"]["name"]
    dep = kube.objects[("Deployment", NS, "chat")]
    body = kube.add_isvc("chat", {"model": {**CACHED["model"], "source": "/opt/m"}}, 2)
    rec.reconcile(body)
    # The serving Deployment stays as it was (the old model) while the new fill runs.
    assert kube.objects[("Deployment", NS, "chat")] == dep
    assert fill_job(kube)["metadata"]["name"] != old_job
    assert ("delete", "Job", old_job) in kube.calls
    assert conds(kube.status("chat"))["Progressing"] == ("True", status.MODEL_CACHE_FILLING)
    finish(kube, "Complete")
    rec.reconcile(body)
    args = kube.objects[("Deployment", NS, "chat")]["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--model") + 1].endswith(cache_key("/opt/m", IMAGE))


def test_a_job_of_that_name_not_ours_is_a_name_conflict(kube, rec):
    built = build_fill_job(OWNER, parse_spec(CACHED), IMAGE)
    kube.put({**built, "metadata": {**built["metadata"], "ownerReferences": []}})
    rec.reconcile(kube.add_isvc("chat", CACHED))
    assert conds(kube.status("chat"))["Degraded"] == ("True", status.NAME_CONFLICT)
