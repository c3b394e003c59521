"""Status from the serving Deployment: Ready / Progressing / Degraded, Kubernetes-style."""

from __future__ import annotations

from batchpilot.operator import status as s
from batchpilot.operator.children.deployment import build_deployment
from batchpilot.operator.children.meta import Owner
from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.state import LoopState

OWNER = Owner("chat", "ns", "uid-1")
URL = "http://chat.ns.svc.cluster.local:8000"


def dep(replicas=2, *, gen=1, observed=1, updated=2, ready=2, available=2, total=None, conds=()):
    d = build_deployment(
        OWNER,
        parse_spec({"replicas": replicas, "engine": {"maxNumSeqs": 48}}),
        image="img:1",
        admin_token="t",
        loops=LoopState(),
    )
    d["metadata"]["generation"] = gen
    d["status"] = {
        "observedGeneration": observed,
        "replicas": updated if total is None else total,
        "updatedReplicas": updated,
        "readyReplicas": ready,
        "availableReplicas": available,
        "conditions": list(conds),
    }
    return d


def conds(st: dict) -> dict:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def compute(deployment, problem=None, prev=None, now="2026-01-01T00:00:00Z", generation=3):
    return s.compute_status(
        name="chat",
        generation=generation,
        prev=prev,
        deployment=deployment,
        problem=problem,
        url=URL,
        now=now,
    )


def test_ready_and_complete():
    st = compute(dep())
    assert conds(st) == {
        "Ready": ("True", "MinimumReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert st["observedGeneration"] == 3
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"]) == (2, 2, 2)
    assert st["url"] == URL and st["image"] == "img:1"
    assert st["engine"]["maxNumSeqs"] == 48 and st["engine"]["kvCacheDtype"] == "auto"
    assert st["selector"] == "app.kubernetes.io/name=batchpilot-server,batchpilot.dev/service=chat"
    for c in st["conditions"]:
        assert c["lastTransitionTime"] == "2026-01-01T00:00:00Z" and c["observedGeneration"] == 3


def test_rollout_in_progress_stays_ready():
    # maxUnavailable 0: old pods serve while the new one starts.
    st = compute(dep(updated=1, ready=2, available=2, total=3))
    assert conds(st)["Ready"] == ("True", "MinimumReplicasReady")
    assert conds(st)["Progressing"] == ("True", "RolloutInProgress")
    st = compute(dep(gen=2, observed=1))
    assert conds(st)["Progressing"] == ("True", "RolloutInProgress")


def test_not_ready_and_scaled_to_zero():
    assert conds(compute(dep(ready=1, available=1)))["Ready"] == ("False", "ReplicasNotReady")
    st = compute(dep(replicas=0, updated=0, ready=0, available=0))
    assert conds(st)["Ready"] == ("False", "ScaledToZero")


def test_deployment_failures_degrade():
    failure = {
        "type": "ReplicaFailure",
        "status": "True",
        "reason": "FailedCreate",
        "message": 'pods "chat-x" is forbidden: error looking up service account',
    }
    st = compute(dep(ready=0, available=0, updated=0, conds=[failure]))
    assert conds(st)["Degraded"] == ("True", "ReplicaFailure")
    assert "service account" in st["conditions"][2]["message"]
    deadline = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "chat-1" has timed out progressing.',
    }
    st = compute(dep(updated=1, ready=1, available=1, conds=[deadline]))
    assert conds(st)["Degraded"] == ("True", "ProgressDeadlineExceeded")
    assert conds(st)["Progressing"] == ("False", "ProgressDeadlineExceeded")


def test_spec_problem_without_children():
    problem = s.Problem(s.MODEL_SOURCE_NOT_FOUND, "PersistentVolumeClaim 'w' not found")
    st = compute(None, problem)
    assert conds(st) == {
        "Ready": ("False", "ModelSourceNotFound"),
        "Progressing": ("False", "ModelSourceNotFound"),
        "Degraded": ("True", "ModelSourceNotFound"),
    }
    assert st["replicas"] == 0 and "engine" not in st
    assert st["conditions"][2]["message"] == "PersistentVolumeClaim 'w' not found"


def test_spec_problem_while_the_old_deployment_serves():
    st = compute(dep(), s.Problem(s.INVALID_SPEC, "bad"))
    assert conds(st)["Ready"] == ("True", "MinimumReplicasReady")
    assert conds(st)["Degraded"] == ("True", "InvalidSpec")
    assert st["engine"]["maxNumSeqs"] == 48  # what is in force, not what was asked


def test_last_transition_time_is_kept_until_the_status_changes():
    first = compute(dep(), now="2026-01-01T00:00:00Z")
    again = compute(dep(), prev=first, now="2026-01-01T00:05:00Z")
    assert again == first
    changed = compute(dep(ready=1, available=1), prev=first, now="2026-01-01T00:06:00Z")
    times = {c["type"]: c["lastTransitionTime"] for c in changed["conditions"]}
    assert times == {
        "Ready": "2026-01-01T00:06:00Z",
        "Progressing": "2026-01-01T00:06:00Z",
        "Degraded": "2026-01-01T00:00:00Z",
    }


def test_kept_problem_is_per_generation():
    st = compute(None, s.Problem(s.INVALID_SPEC, "bad"), generation=4)
    assert s.kept_problem(st, 4) == s.Problem(s.INVALID_SPEC, "bad")
    assert s.kept_problem(st, 5) is None
    assert s.kept_problem(compute(dep()), 3) is None


def test_loop_blind_condition_follows_what_the_loop_wrote():
    why = "1 of 4 Ready replicas answered their scrape: http://r1: timeout"
    blind = compute(dep(), prev={"metrics": {"loopBlind": why}}, now="2026-01-01T00:00:00Z")
    assert conds(blind)["LoopBlind"] == ("True", "ReplicasUnscraped")
    (c,) = [c for c in blind["conditions"] if c["type"] == "LoopBlind"]
    assert c["message"] == why and c["observedGeneration"] == 3
    # The loop sees again (it wrote None, merge-patched away): False, with a new transition.
    sighted = compute(
        dep(), prev={**blind, "metrics": {"loopBlind": None}}, now="2026-01-01T00:05:00Z"
    )
    assert conds(sighted)["LoopBlind"] == ("False", "ReplicasScraped")
    (c,) = [c for c in sighted["conditions"] if c["type"] == "LoopBlind"]
    assert c["lastTransitionTime"] == "2026-01-01T00:05:00Z"
    # Still blind a turn later: the transition time is kept.
    again = compute(
        dep(), prev={**blind, "metrics": {"loopBlind": "still"}}, now="2026-01-01T00:09:00Z"
    )
    (c,) = [c for c in again["conditions"] if c["type"] == "LoopBlind"]
    assert c["lastTransitionTime"] == "2026-01-01T00:00:00Z" and c["message"] == "still"


def test_no_loop_blind_condition_before_any_loop_ran():
    assert "LoopBlind" not in conds(compute(dep()))
    assert "LoopBlind" not in conds(compute(dep(), prev={"metrics": "garbage"}))
    assert s.loop_blind({"metrics": {}}) == (
        False,
        "ReplicasScraped",
        "enough replicas answer their scrape to decide",
    )
