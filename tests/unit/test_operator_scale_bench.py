"""benchmarks/operator_scale's pure parts: the API server's request counters and their
rates, the longest gap between a service's loop turns, the loopback check, and what the
benchmark counts as Ready, observed and its own traffic."""

from __future__ import annotations

import json

import pytest

from benchmarks.operator_scale import measure, scale
from benchmarks.operator_scale.__main__ import targets

EXPOSITION = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",group="batchpilot.dev",resource="inferenceservices",scope="resource",subresource="status",verb="PATCH",version="v1alpha1"} 10
apiserver_request_total{code="409",component="apiserver",group="batchpilot.dev",resource="inferenceservices",scope="resource",subresource="status",verb="PATCH",version="v1alpha1"} 2
apiserver_request_total{code="200",component="apiserver",group="apps",resource="deployments",scope="resource",subresource="",verb="GET",version="v1"} 7
apiserver_request_total{code="200",component="apiserver",group="",resource="",scope="",subresource="",verb="GET",version=""} 3
# HELP apiserver_request_duration_seconds Response latency
# TYPE apiserver_request_duration_seconds histogram
apiserver_request_duration_seconds_count{resource="deployments",verb="GET"} 99
"""
STATUS_PATCH = ("PATCH", "inferenceservices", "status")
GET_DEPLOYMENT = ("GET", "deployments", "")


def test_request_counts_sum_over_codes_and_ignore_other_families():
    counts = measure.request_counts(EXPOSITION)
    assert counts[STATUS_PATCH] == 12  # 200s and 409s: both are requests made
    assert counts[GET_DEPLOYMENT] == 7  # not the duration histogram's 99
    assert counts[("GET", "", "")] == 3


def test_delta_and_rates_per_minute_by_verb():
    before = measure.request_counts(EXPOSITION)
    after = before.copy()
    after[STATUS_PATCH] += 30
    after[GET_DEPLOYMENT] += 15
    after[("APPLY", "services", "")] = 6  # a key that appeared in the window
    delta = measure.request_delta(before, after)
    assert delta == {STATUS_PATCH: 30, GET_DEPLOYMENT: 15, ("APPLY", "services", ""): 6}
    assert measure.per_minute_by_verb(delta, 30) == {"APPLY": 12.0, "GET": 30.0, "PATCH": 60.0}
    by_request = measure.per_minute_by_request(delta, 60)
    assert list(by_request) == [
        "PATCH inferenceservices/status",
        "GET deployments",
        "APPLY services",
    ]


def test_the_benchmarks_own_requests_are_left_out():
    delta = {("LIST", "inferenceservices", ""): 12, GET_DEPLOYMENT: 4}
    left = measure.without(delta, {("LIST", "inferenceservices", ""): 12, ("GET", "", ""): 1})
    assert left == {GET_DEPLOYMENT: 4}


def test_turn_gaps_count_from_the_last_turn_before_the_window():
    # Turns every 15 s from t=95; the window is [100, 160]: the first gap is 95 -> 110.
    assert measure.turn_gaps([80, 95, 110, 125, 140, 155], 100, 160) == pytest.approx(15)


def test_a_service_that_stops_turning_shows_the_whole_silence():
    assert measure.turn_gaps([95, 110], 100, 200) == pytest.approx(90)  # 110 -> the end
    assert measure.turn_gaps([], 100, 200) == pytest.approx(100)  # never seen
    assert measure.turn_gaps([50], 100, 200) == pytest.approx(150)  # last seen long before


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert measure.percentile(values, 50) == 50
    assert measure.percentile(values, 99) == 99
    assert measure.percentile([7.0], 99) == 7


@pytest.mark.parametrize(
    ("addresses", "offenders"),
    [
        (["127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1"], []),
        (["127.0.0.1", "10.244.0.7", "10.244.0.7"], ["10.244.0.7"]),
        (["::ffff:10.244.1.2", "192.168.1.1"], ["192.168.1.1", "::ffff:10.244.1.2"]),
    ],
)
def test_only_loopback_passes(addresses, offenders):
    assert measure.non_loopback(addresses) == offenders


def service(generation=2, observed=2, ready="True", progressing="False", time=None) -> dict:
    status = {
        "observedGeneration": observed,
        "conditions": [
            {"type": "Ready", "status": ready},
            {"type": "Progressing", "status": progressing},
        ],
    }
    if time:
        status["metrics"] = {"time": time}
    return {"metadata": {"name": "svc-0001", "generation": generation}, "status": status}


def test_ready_needs_ready_not_progressing_and_this_generation():
    assert scale.is_ready(service())
    assert not scale.is_ready(service(ready="False"))
    assert not scale.is_ready(service(progressing="True"))
    assert not scale.is_ready(service(observed=1))
    assert not scale.is_ready({"metadata": {"generation": 1}})


def test_turn_times_are_read_from_the_operators_last_round_gauge():
    def exposition(t: float) -> str:
        return (
            f"# TYPE {scale.LAST_ROUND} gauge\n"
            f'{scale.LAST_ROUND}{{name="svc-0001",namespace="scale"}} {t}\n'
            'batchpilot_operator_loop_rounds_total{name="svc-0001",namespace="scale"} 3.0\n'
        )

    times: dict[str, set[float]] = {}
    scale.record_turns(exposition(1796425200.5), times)
    scale.record_turns(exposition(1796425200.5), times)  # no turn since: one time
    scale.record_turns(exposition(1796425215.5), times)
    assert times == {"svc-0001": {1796425200.5, 1796425215.5}}


def test_the_spec_pins_the_autoscaler_so_nothing_scales():
    spec = scale.service_spec(5)
    assert spec["autoscaling"] == {"enabled": True, "minReplicas": 5, "maxReplicas": 5}


def test_a_point_not_reconciled_misses_that_target():
    point = {
        "reconcile_all_s": None,
        "max_observe_gap_s": 15.2,
        "steady_writes_per_service_per_min": 4.0,
        "operator_rss_mib": 300.0,
    }
    assert targets(point) == {
        "reconcile_all_s": False,
        "max_observe_gap_s": True,
        "steady_writes_per_service_per_min": False,
        "operator_rss_mib": True,
    }


def test_first_applies_keep_each_services_first_apply_from_the_json_log():
    def line(name, message, timestamp):
        obj = {"name": name, "namespace": "scale"}
        return json.dumps({"message": message, "timestamp": timestamp, "object": obj})

    log = [
        line("svc-0001", "Applied generation 1: image x", "2026-12-04T23:00:01+00:00"),
        "not json: Applied generation",
        line("svc-0002", "Timer 'loop' succeeded.", "2026-12-04T23:00:02+00:00"),
        line("svc-0001", "Applied generation 2: image y", "2026-12-04T23:00:09+00:00"),
        line("svc-0002", "Applied generation 1: image x", "2026-12-04T23:00:03+00:00"),
    ]
    assert measure.first_applies(log) == {"svc-0001": 1796425201.0, "svc-0002": 1796425203.0}


def test_the_fault_verdict_fails_on_anything_recreated_rolled_or_lost():
    from benchmarks.operator_scale import faults

    text = (
        "# TYPE batchpilot_operator_api_requests counter\n"
        'batchpilot_operator_api_requests_total{verb="get",code="200"} 5.0\n'
        'batchpilot_operator_api_requests_total{verb="patch",code="error"} 2.0\n'
        'batchpilot_operator_api_requests_total{verb="get",code="error"} 1.0\n'
    )
    assert faults.counter_by(text, faults.API_REQUESTS, "code") == {"200": 5.0, "error": 3.0}
    good = {
        "all_services_have_a_deployment": True,
        "operator_alive": True,
        "recreated_deployments": [],
        "deployments_with_more_than_one_replicaset": [],
        "services_with_other_than_their_replicas_pods": [],
    }
    assert faults.passed(good)
    for key, bad in (("operator_alive", False), ("recreated_deployments", ["svc-0001"]),
                     ("deployments_with_more_than_one_replicaset", ["svc-0002"]),
                     ("all_services_have_a_deployment", False)):  # fmt: skip
        assert not faults.passed({**good, key: bad})
