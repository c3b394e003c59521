"""The activator's wake request runs a loop turn when its watch event arrives: kopf leaves
the annotation out of what it diffs (it sits under kopf's own storage prefix), so the turn
is decided from the raw events, once per new request."""

from __future__ import annotations

import kopf

from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.handlers import configure_settings
from batchpilot.operator.loop.idle import WAKE_ANNOTATION
from batchpilot.operator.loop.timer import LoopTimer
from batchpilot.operator.reconcile import Reconciler
from tests.support.fake_kube import KEY as ADMIN_KEY
from tests.support.fake_kube import FakeKube


def timer() -> LoopTimer:
    config = OperatorConfig(server_image="img:1", admin_key=ADMIN_KEY)
    return LoopTimer(config, Reconciler(config, kube=FakeKube()))


def isvc(wake: str | None, name: str = "chat") -> dict:
    annotations = {WAKE_ANNOTATION: wake} if wake is not None else {}
    return {"metadata": {"namespace": "ns", "name": name, "annotations": annotations}}


def test_kopf_does_not_diff_the_wake_annotation_so_no_field_handler_could_see_it():
    settings = kopf.OperatorSettings()
    configure_settings(settings, OperatorConfig(server_image="img:1", admin_key=ADMIN_KEY))
    body = isvc("2026-12-05T10:00:00.000Z")
    body["metadata"]["annotations"]["batchpilot.dev/kopf-managed"] = "yes"
    body["spec"] = {"replicas": 1}
    essence = settings.persistence.diffbase_storage.build(body=kopf.Body(body))
    assert WAKE_ANNOTATION not in (essence.get("metadata") or {}).get("annotations", {})
    assert essence["spec"] == {"replicas": 1}


def test_a_new_wake_request_runs_a_turn_once():
    t = timer()
    assert t.wake_is_new(isvc("2026-12-05T10:00:00.000Z"), listed=False)
    # The turn's own status patches come back with the same request: no second turn.
    assert not t.wake_is_new(isvc("2026-12-05T10:00:00.000Z"), listed=False)
    # The activator asks again while requests are held: a turn again.
    assert t.wake_is_new(isvc("2026-12-05T10:00:05.000Z"), listed=False)
    assert not t.wake_is_new(isvc(None), listed=False)
    assert not t.wake_is_new(isvc("not a time"), listed=False)


def test_a_request_first_seen_in_the_initial_listing_is_remembered_not_turned():
    t = timer()
    assert not t.wake_is_new(isvc("2026-12-05T10:00:00.000Z"), listed=True)
    assert not t.wake_is_new(isvc("2026-12-05T10:00:00.000Z"), listed=False)
    assert t.wake_is_new(isvc("2026-12-05T10:01:00.000Z"), listed=False)


def test_services_are_kept_apart_and_a_deleted_one_is_forgotten():
    t = timer()
    assert t.wake_is_new(isvc("2026-12-05T10:00:00.000Z", "a"), listed=False)
    assert t.wake_is_new(isvc("2026-12-05T10:00:00.000Z", "b"), listed=False)
    t.forget("ns", "a")
    assert t.wake_is_new(isvc("2026-12-05T10:00:00.000Z", "a"), listed=False)
