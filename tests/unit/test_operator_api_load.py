"""What keeps the operator's API load flat at scale: the loop holds its figures between
status writes (milestones at once), the timer's resync skips services whose last full
reconcile found nothing wrong, the loop reads Deployments from what their watch showed,
and the operator's /metrics count its API requests and kopf's watch restarts. The
benchmark at 1,000 services is benchmarks/operator_scale."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading

import pytest

from batchpilot.operator import log_filters, probes, refresh
from batchpilot.operator.coalesce import Coalescer
from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.loop.admin_client import AdminClient
from batchpilot.operator.loop.state import LoopState
from batchpilot.operator.loop.status_memory import StatusMemory, compose, fingerprint, merge_patch
from batchpilot.operator.loop.timer import LoopTimer
from batchpilot.operator.loop.turn import ClosedLoop
from batchpilot.operator.reconcile import Reconciler
from batchpilot.operator.remembered import Deployments, Resyncs
from tests.support.fake_kube import KEY as ADMIN_KEY
from tests.support.fake_kube import NS, FakeKube, QueuedSource, conds
from tests.support.wait import wait_for

KEY = (NS, "chat")


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def figures(queue: float, t: str) -> dict:
    """A turn's patch that decides nothing: only the window's figures move."""
    return {"metrics": {"waiting": queue, "time": t}, "autoscaling": {"desiredReplicas": 2}}


# --------------------------------------------------------------------------- status memory


def test_merge_patch_and_compose_follow_rfc_7386():
    target = {"a": {"b": 1, "c": 2}, "d": 3}
    first, second = {"a": {"b": None, "e": 5}}, {"a": {"c": 9}, "d": None}
    assert merge_patch(target, first) == {"a": {"c": 2, "e": 5}, "d": 3}
    assert merge_patch(merge_patch(target, first), second) == merge_patch(
        target, compose(first, second)
    )


def test_fingerprint_reads_a_status_as_the_api_server_gives_it_back():
    sent = {"metrics": {"waiting": 3.0, "rate": 0.25, "loopBlind": None}, "url": "x"}
    back = {"metrics": {"waiting": 3, "rate": 0.25}, "url": "y"}  # other keys do not count
    assert fingerprint(sent) == fingerprint(back)
    assert fingerprint(sent) != fingerprint({"metrics": {"waiting": 4, "rate": 0.25}})


def test_figures_are_held_and_written_once_per_interval():
    clock = Clock()
    memory = StatusMemory(60, clock)
    stored: dict = {}
    writes = []
    for turn in range(8):  # 15 s apart: two minutes
        before = memory.current(KEY, stored)
        patch = memory.record(KEY, before, figures(turn, f"t{turn}"), False, 0.0)
        if patch is not None:
            writes.append(turn)
            stored = merge_patch(stored, patch)
        clock.now += 15
    assert writes == [0, 4]  # the first turn, then one a minute
    # What a turn starts from is the latest turn's, not the last write's.
    assert memory.current(KEY, stored)["metrics"]["waiting"] == 7
    assert stored["metrics"]["waiting"] == 4


def test_figures_wait_while_the_service_rolls_out_and_decisions_do_not():
    """1,000 services made together: the turns' figures are not written until each
    service's rollout ends; a decision is, and the first turn after the rollout writes."""
    clock = Clock()
    memory = StatusMemory(60, clock)
    progressing = {"conditions": [{"type": "Progressing", "status": "True"}]}
    writes = []
    for turn in range(8):  # two minutes of a rollout
        patch = memory.record(KEY, memory.current(KEY, progressing), figures(turn, f"t{turn}"),
                              False, 0.0)  # fmt: skip
        writes.append(patch)
        clock.now += 15
    assert writes[0] is not None  # its first decision (2 replicas) goes at once
    assert writes[1:] == [None] * 7
    scale = {"autoscaling": {"desiredReplicas": 3}}
    decided = memory.record(KEY, memory.current(KEY, progressing), scale, False, 0.0)
    assert decided["autoscaling"]["desiredReplicas"] == 3
    assert decided["metrics"]["waiting"] == 7  # the held figures go with the decision
    done = merge_patch({"conditions": [{"type": "Progressing", "status": "False"}]}, decided)
    clock.now += 61
    after = memory.record(KEY, memory.current(KEY, done), figures(9, "t9"), False, 0.0)
    assert after is not None and after["metrics"]["waiting"] == 9


def first_write() -> tuple[Clock, StatusMemory, dict]:
    """A memory after its first turn (always written) and the status that write left."""
    clock = Clock()
    memory = StatusMemory(60, clock)
    return clock, memory, merge_patch({}, memory.record(KEY, {}, figures(1, "t0"), False, 0.0))


def test_a_milestone_or_an_event_is_written_in_its_turn_with_everything_held():
    clock, memory, stored = first_write()
    clock.now += 15
    held = memory.record(KEY, memory.current(KEY, stored), figures(2, "t1"), False, 0.0)
    assert held is None
    clock.now += 15
    scale = {"metrics": {"time": "t2"}, "autoscaling": {"desiredReplicas": 3}}
    patch = memory.record(KEY, memory.current(KEY, stored), scale, False, 0.0)
    assert LoopState.from_status(merge_patch(stored, patch)).replicas == 3
    assert patch["metrics"] == {"waiting": 2, "time": "t2"}  # the held figures go with it
    stored = merge_patch(stored, patch)
    clock.now += 15
    evented = memory.record(KEY, memory.current(KEY, stored), figures(5, "t3"), True, 0.0)
    assert evented is not None and evented["metrics"]["waiting"] == 5


def test_someone_elses_write_wins_over_what_is_held_and_the_next_turn_writes():
    clock, memory, stored = first_write()
    clock.now += 15
    assert memory.record(KEY, memory.current(KEY, stored), figures(2, "t1"), False, 0.0) is None
    # Another replica of the operator (or a person) writes the loop's keys meanwhile.
    theirs = merge_patch(stored, {"autoscaling": {"capacityTokensPerSecond": None}, "metrics":
                                  {"waiting": 9, "time": "theirs"}})  # fmt: skip
    assert memory.current(KEY, theirs) == theirs
    clock.now += 15
    assert memory.record(KEY, theirs, figures(3, "t2"), False, 0.0) is not None


def test_a_watch_that_lags_behind_own_writes_still_reads_as_own():
    clock, memory, first = first_write()
    clock.now += 61
    second = memory.record(KEY, memory.current(KEY, first), figures(2, "t1"), False, 0.0)
    assert second is not None
    clock.now += 15
    memory.record(KEY, memory.current(KEY, merge_patch(first, second)), figures(3, "t2"),
                  False, 0.0)  # fmt: skip
    # The watch still shows the first write: the turn starts from the latest state anyway.
    assert memory.current(KEY, first)["metrics"]["waiting"] == 3


def test_the_loop_timer_writes_figures_once_a_minute_and_decisions_at_once():
    config = OperatorConfig(server_image="img:1", admin_key=ADMIN_KEY, status_interval=60)
    rec = Reconciler(config, kube=FakeKube())
    kube = rec.kube
    autoscaling = {"enabled": True, "minReplicas": 2, "maxReplicas": 8, "targetQueueLength": 2,
                   "scaleUpStabilizationSeconds": 0}  # fmt: skip
    rec.reconcile(kube.add_isvc("chat", {"autoscaling": autoscaling}))
    now = [1_000_000.0]
    timer = LoopTimer(config, rec, ClosedLoop(QueuedSource(), AdminClient(), lambda: now[0]))
    kube.calls.clear()
    seen = []
    for _ in range(12):  # 12 turns within a second of the operator's clock
        asyncio.run(timer.tick(kube.read_isvc(NS, "chat")))
        deployment = kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"]
        seen.append((kube.status("chat")["autoscaling"]["desiredReplicas"], deployment))
        now[0] += 15
    # Every scale decision reached status and the Deployment in its own turn.
    assert all(status == deployment for status, deployment in seen), seen
    assert seen[-1][0] > 2
    scale_changes = len({s for s, _ in seen})
    writes = sum(1 for c in kube.calls if c[0] == "status")
    # The turns' figures cost one write (the first turn's), the decisions one each; the
    # reconciles those decisions ran write status too (replica counts, conditions).
    loop_writes = writes - sum(1 for c in kube.calls if c[:2] == ("apply", "Deployment"))
    assert loop_writes <= 1 + scale_changes < 12, kube.calls
    # The loop read its Deployment from what it last saw, not with a GET per turn.
    assert len([c for c in kube.calls if c[:2] == ("read", "Deployment")]) < 12, kube.calls


# --------------------------------------------------------------------------- resync


def test_resyncs_skip_until_due_and_on_nothing_changed():
    clock = Clock()
    resyncs = Resyncs(600, clock)
    loops = LoopState(replicas=2)
    assert not resyncs.in_sync(KEY, 1, loops)  # never reconciled here
    resyncs.good(KEY, 1, loops)
    assert resyncs.in_sync(KEY, 1, loops)
    assert not resyncs.in_sync(KEY, 2, loops)  # a new generation
    assert not resyncs.in_sync(KEY, 1, LoopState(replicas=3))  # the loop decided
    clock.now += resyncs.period(KEY)
    assert not resyncs.in_sync(KEY, 1, loops)  # due
    assert 600 <= resyncs.period(KEY) < 660
    periods = {Resyncs(600).period((NS, f"svc-{i}")) for i in range(50)}
    assert len(periods) > 40  # spread: services made together resync apart


@pytest.fixture
def rec():
    config = OperatorConfig(server_image="img:1", admin_key=ADMIN_KEY)
    return Reconciler(config, kube=FakeKube())


def test_the_timers_resync_reads_nothing_while_a_healthy_service_is_in_sync(rec):
    kube = rec.kube
    rec.reconcile(kube.add_isvc("chat", {}))
    kube.calls.clear()
    rec.resync_by_name(NS, "chat", kube.read_isvc(NS, "chat"))
    assert kube.calls == []
    # An edit not yet seen by the update handler: the resync reconciles it.
    body = kube.add_isvc("chat", {"replicas": 3}, generation=2)
    rec.resync_by_name(NS, "chat", body)
    assert kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 3


def test_a_creation_replayed_from_an_old_watch_event_reads_nothing(rec):
    """Behind a loaded API server kopf took an event older than its own patch for the
    latest and ran the creation again (116 of 1,000 services): this process reconciled
    that object at that generation, so the replay asks nothing. The same name made
    again, a new generation, or a due resync is reconciled."""
    kube = rec.kube
    body = kube.add_isvc("chat", {})
    rec.create_by_name(body)
    assert ("Deployment", NS, "chat") in kube.objects
    kube.calls.clear()
    rec.create_by_name(body)
    assert kube.calls == []
    remade = copy.deepcopy(body)
    remade["metadata"]["uid"] = "uid-chat-again"
    rec.create_by_name(remade)
    assert ("read", "Deployment", "chat") in kube.calls  # reconciled: another object
    kube.calls.clear()
    rec.create_by_name(kube.add_isvc("chat", {"replicas": 3}, generation=2))
    assert kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 3


def test_a_loop_decision_the_deployment_already_runs_needs_no_full_reconcile(rec):
    """The first turn of every service decides the replicas already running: the timer's
    check builds the children from it, finds them as applied, and asks nothing (a full
    reconcile is 13 requests, at 1,000 services made at once). A decision that changes a
    child is applied; a due resync is a full one whatever the loop decided."""
    kube = rec.kube
    spec = {"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 5}}
    rec.reconcile(kube.add_isvc("chat", spec))
    kube.patch_isvc_status(NS, "chat", {"autoscaling": {"desiredReplicas": 3}})  # what runs
    kube.calls.clear()
    rec.resync_by_name(NS, "chat", kube.read_isvc(NS, "chat"))
    rec.resync_by_name(NS, "chat", kube.read_isvc(NS, "chat"))  # remembered: not built again
    assert kube.calls == []
    kube.patch_isvc_status(NS, "chat", {"autoscaling": {"desiredReplicas": 4}})
    rec.resync_by_name(NS, "chat", kube.read_isvc(NS, "chat"))
    assert kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 4


def test_a_due_resync_is_full_even_when_the_loop_decided_what_runs():
    kube = FakeKube()
    config = OperatorConfig(server_image="img:1", admin_key=ADMIN_KEY, resync_interval=1e-6)
    rec_ = Reconciler(config, kube=kube)
    spec = {"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 5}}
    rec_.reconcile(kube.add_isvc("chat", spec))
    kube.patch_isvc_status(NS, "chat", {"autoscaling": {"desiredReplicas": 3}})
    kube.calls.clear()
    rec_.resync_by_name(NS, "chat", kube.read_isvc(NS, "chat"))
    assert ("read", "Deployment", "chat") in kube.calls


def test_a_degraded_service_is_reconciled_at_every_check(rec):
    kube = rec.kube
    spec = {"model": {"source": "pvc://weights/smol"}}
    rec.reconcile(kube.add_isvc("chat", spec))
    kube.calls.clear()
    rec.resync_by_name(NS, "chat", kube.read_isvc(NS, "chat"))
    assert kube.calls, "a degraded service's check is a full reconcile"
    kube.pvcs.add("weights")
    rec.resync_by_name(NS, "chat", kube.read_isvc(NS, "chat"))
    assert ("Deployment", NS, "chat") in kube.objects  # the claim appeared: built


def test_a_due_resync_reads_and_applies_again():
    kube = FakeKube()
    config = OperatorConfig(server_image="img:1", admin_key=ADMIN_KEY, resync_interval=1e-6)
    rec_ = Reconciler(config, kube=kube)
    rec_.reconcile(kube.add_isvc("chat", {}))
    kube.calls.clear()
    rec_.resync_by_name(NS, "chat", kube.read_isvc(NS, "chat"))
    assert ("read", "Deployment", "chat") in kube.calls


# --------------------------------------------------------------------------- deployments


def dep(version: str, replicas: int, name: str = "chat") -> dict:
    return {"metadata": {"name": name, "resourceVersion": version}, "spec": {"replicas": replicas}}


def test_the_latest_copy_of_a_deployment_is_kept():
    seen = Deployments()
    seen.seen(KEY, None, dep("120", 3))  # what an apply returned
    seen.seen(KEY, "MODIFIED", dep("118", 2))  # a late watch event
    assert seen.get(KEY)["spec"]["replicas"] == 3
    seen.seen(KEY, "MODIFIED", dep("121", 4))
    assert seen.get(KEY)["spec"]["replicas"] == 4
    seen.seen(KEY, "MODIFIED", dep("122", 1, name="other"))  # not the serving one
    assert seen.get(KEY)["spec"]["replicas"] == 4
    seen.seen(KEY, "DELETED", dep("123", 4))
    assert seen.get(KEY) is None


# --------------------------------------------------------------------------- bring-up


def ready_events(rec_, kube, readies) -> None:
    """The Deployment "chat" of 5 replicas, its ready count moving through `readies`, one
    MODIFIED event each."""
    live = kube.objects[("Deployment", NS, "chat")]
    for ready in readies:
        live["status"] = {"observedGeneration": 1, "replicas": 5, "updatedReplicas": 5,
                          "readyReplicas": ready, "availableReplicas": ready}  # fmt: skip
        rec_.on_deployment_event("MODIFIED", copy.deepcopy(live))


def test_a_bring_ups_deployment_events_make_one_status_refresh():
    """While a service starts, its Deployment's ready count moves 0 to 5 in quick events:
    they are merged into one refresh (one read of the Deployment, one status write), made
    from the Deployment as it is then, instead of a read and a write each (5 status writes
    a service while 1,000 were made). The bring-up writes status twice in all: the
    reconcile's, and the refresh's with Ready."""
    config = OperatorConfig(server_image="img:1", admin_key=ADMIN_KEY)
    kube = FakeKube()
    rec_ = Reconciler(config, kube=kube, refresh_delay=3600)  # runs when flushed, here
    rec_.reconcile(kube.add_isvc("chat", {"replicas": 5}))
    assert [c for c in kube.calls if c[0] == "status"] == [("status", "chat")]
    kube.calls.clear()
    ready_events(rec_, kube, range(6))
    assert kube.calls == []  # nothing read or written yet: one refresh to come
    assert rec_._refreshes.pending() == 1
    rec_._refreshes.flush()
    assert kube.calls == [("read", "Deployment", "chat"), ("status", "chat")]
    st = kube.status("chat")
    assert st["readyReplicas"] == 5 and st["conditions"][0]["status"] == "True"


def test_a_change_of_ready_is_written_at_once_and_the_counts_between_wait(monkeypatch):
    """The counts on their way (0 to 4 of 5 ready) wait for COUNT_DELAY (an hour here);
    the event that makes the service Ready brings the one refresh forward to the short
    delay."""
    monkeypatch.setattr(refresh, "COUNT_DELAY", 3600.0)
    config = OperatorConfig(server_image="img:1", admin_key=ADMIN_KEY)
    kube = FakeKube()
    rec_ = Reconciler(config, kube=kube, refresh_delay=0.05)
    rec_.reconcile(kube.add_isvc("chat", {"replicas": 5}))
    kube.calls.clear()
    ready_events(rec_, kube, range(5))
    assert rec_._refreshes.pending() == 1 and kube.calls == []  # an hour away
    ready_events(rec_, kube, [5])
    wait_for("Ready", lambda: conds(kube.status("chat"))["Ready"][0] == "True", timeout=60)
    assert [c for c in kube.calls if c[0] == "status"] == [("status", "chat")]
    assert rec_._refreshes.pending() == 0


def test_a_sooner_request_brings_a_pending_run_forward():
    ran, done = [], threading.Event()
    merged = Coalescer(3600, lambda k, v: (ran.append((k, v)), done.set()))
    merged.request("a", 1)  # an hour away
    merged.request("a", 2, delay=0.01)
    assert done.wait(timeout=30)
    assert ran == [("a", 2)] and merged.pending() == 0


def test_the_coalescer_runs_a_key_once_after_its_delay_with_the_latest_value():
    ran, done = [], threading.Event()

    def run(key, value):
        ran.append((key, value))
        if key == "last":
            done.set()

    merged = Coalescer(1.0, run)
    for value in range(3):
        merged.request("a", value)
    merged.request("last", None)  # due after "a": once it ran, "a" has
    assert done.wait(timeout=30)
    assert ran == [("a", 2), ("last", None)]
    assert merged.pending() == 0


def test_a_flushed_request_does_not_run_again_and_delay_0_runs_at_once():
    ran, done = [], threading.Event()
    merged = Coalescer(0.2, lambda k, v: (ran.append((k, v)), k == "b" and done.set()))
    merged.request("a", 1)
    merged.flush()
    assert ran == [("a", 1)]
    merged.request("b", 2)  # due after a's entry, which finds nothing left to run
    assert done.wait(timeout=30)
    assert ran == [("a", 1), ("b", 2)]
    at_once = []
    Coalescer(0, lambda k, v: at_once.append((k, v))).request("c", 3)
    assert at_once == [("c", 3)]


# --------------------------------------------------------------------------- /metrics


@pytest.mark.parametrize(
    "message, restart",
    [
        ("Restarting the watch-stream for deployments.v1.apps in 'team-a'.",
         ("deployments.v1.apps", "expired")),
        ("Watch-stream for services.v1 cluster-wide is inactive, reconnecting.",
         ("services.v1", "inactive")),
        ("Starting the watch-stream for services.v1 in 'team-a'.", None),
    ],
)  # fmt: skip
def test_kopfs_watch_restart_lines_are_recognised(message, restart):
    assert log_filters.restart_reason(message) == restart


def test_a_410_restart_is_counted_and_logged_at_info_and_other_debug_lines_stay_out(caplog):
    logger = logging.getLogger(log_filters.WATCHING_LOGGER)
    log_filters.install(verbose=False)
    labels = {"resource": "pods.v1", "reason": "expired"}
    name = "batchpilot_operator_watch_restarts_total"
    before = probes.REGISTRY.get_sample_value(name, labels) or 0
    with caplog.at_level(logging.DEBUG):
        logger.debug("Restarting the watch-stream for pods.v1 in 'x'.")
        logger.debug("Starting the watch-stream for pods.v1 in 'x'.")
    assert probes.REGISTRY.get_sample_value(name, labels) == before + 1
    shown = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == logger.name]
    assert shown == [("INFO", "Restarting the watch-stream for pods.v1 in 'x'.")]


def test_kopfs_success_lines_are_dropped_and_everything_else_kept(caplog):
    log_filters.install(verbose=False)
    logger = logging.getLogger(log_filters.OBJECTS_LOGGER)
    with caplog.at_level(logging.INFO):
        logger.info("Timer 'loop' succeeded.")
        logger.info("Handler 'child' succeeded.")
        logger.info("Applied generation 2: image x")
        logger.error("Timer 'loop' failed with an exception. Will retry.")
    shown = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert shown == [
        "Applied generation 2: image x",
        "Timer 'loop' failed with an exception. Will retry.",
    ]


def test_api_requests_are_counted_by_verb_and_code():
    from kubernetes.client import ApiException

    from batchpilot.operator.kube import Kube

    class Answer:
        status, data = 200, "{}"

    class Dynamic:
        def get(self, resource, **_):
            if resource == "gone":
                raise ApiException(status=404)
            if resource == "down":
                raise ConnectionRefusedError
            return Answer()

    kube = Kube.__new__(Kube)
    kube.dynamic = Dynamic()
    name = "batchpilot_operator_api_requests_total"

    def count(code: str) -> float:
        return probes.REGISTRY.get_sample_value(name, {"verb": "get", "code": code}) or 0

    before = {c: count(c) for c in ("200", "404", "error")}
    kube._call("get", "found")
    with pytest.raises(ApiException):
        kube._call("get", "gone")
    with pytest.raises(ConnectionRefusedError):
        kube._call("get", "down")
    assert {c: count(c) - before[c] for c in before} == {"200": 1, "404": 1, "error": 1}


def test_a_reconcile_a_child_event_triggers_logs_about_the_inference_service(rec, caplog):
    """Its "Applied" line names the InferenceService, not the PDB whose event ran it (a
    CI run saw a standby's first reconcile attributed to the PDB)."""
    import kopf

    kube = rec.kube
    kube.add_isvc("chat", {})
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": {"name": "chat", "namespace": NS, "uid": "u-pdb"}}  # fmt: skip
    child_logger = kopf.LocalObjectLogger(body=pdb, settings=kopf.OperatorSettings())
    with caplog.at_level(logging.INFO, logger="kopf.objects"):
        rec.reconcile_by_name(NS, "chat", child_logger)
    (applied,) = [r for r in caplog.records if r.getMessage().startswith("Applied generation")]
    assert applied.k8s_ref["kind"] == "InferenceService" and applied.k8s_ref["name"] == "chat"
