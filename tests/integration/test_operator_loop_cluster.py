"""The closed loop through the real control plane: the operator (kopf.testing.KopfRunner)
runs its loop timer against real `batchpilot serve` processes on 127.0.0.1, and its
decisions must show up where a user looks: the Deployment's replicas and pod template, the
ConfigMap new pods read, the InferenceService's status and Events, `kubectl get bpis`, and
the operator's own /metrics.

kwok's pods serve nothing and their IPs are fake, so the operator is fed through its URL
metrics source (OperatorConfig.metrics_urls, and admin_urls: each server's admin API has its
own port) from servers outside the cluster: the pods stand for them. No traffic goes to a
pod IP: every operator here has metrics URLs. Each server runs with the admin token the
operator derives for its InferenceService, so it starts once that object exists.
"""

from __future__ import annotations

import httpx
import pytest
from kubernetes import client

from batchpilot import names
from batchpilot.server.bench.server_process import free_port
from tests.support.cluster import (
    LOOP_TIMEOUT,
    Api,
    load,
    loop_operator,
    not_found,
    server,
    start,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster


def history(api: Api, name: str) -> list[dict]:
    return ((api.get(name).get("status") or {}).get("tuning") or {}).get("history") or []


def events(api: Api, name: str) -> dict[str, str]:
    """reason -> message of the Events on the InferenceService."""
    return {
        e.reason: e.message
        for e in api.core.list_namespaced_event(api.ns).items
        if e.involved_object.kind == "InferenceService" and e.involved_object.name == name
    }


def replica_sets(api: Api, name: str) -> list[int]:
    rss = api.apps.list_namespaced_replica_set(
        api.ns, label_selector=f"batchpilot.dev/service={name}"
    ).items
    return sorted(rs.spec.replicas for rs in rss)


def test_raise_and_scale_up_reach_the_servers_the_deployment_and_status(
    api, k8s, tiny_path, tmp_path
):
    """A slot-bound server (max_num_seqs 2, a queue of 8, KV mostly free): the queue
    guardrail raises max_num_seqs at once, live on the server and in the ConfigMap without
    rolling the pods,
    and the autoscaler adds replicas to the Deployment; Events, status, the printer column
    and the operator's own metrics all show it. The tuning range stops at 4, so the load
    (10 clients) still queues at the raised setting (10 / (4 + 1) = 2 replicas): the
    scale-up does not depend on which decision lands first."""
    srv = server(tiny_path, tmp_path, "--max-num-seqs", "2")
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    spec = {
        "engine": {"maxNumSeqs": 2},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 2, "max": 4}, "cooldownSeconds": 0,
                   "targetInterTokenLatencySeconds": 60},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3,
                        "targetQueueLength": 1, "scaleUpStabilizationSeconds": 1},
    }  # fmt: skip
    try:
        with loop_operator(api, [srv], liveness):
            api.create("chat", spec)
            start(srv, api, "chat")
            wait_for("Ready", lambda: api.ready("chat"), timeout=LOOP_TIMEOUT, not_yet=not_found)
            assert replica_sets(api, "chat") == [1]
            with load(srv, workers=10, max_tokens=48):
                raised_entry = wait_for(
                    "a guardrail raise of max_num_seqs",
                    lambda: next((h for h in history(api, "chat") if h["kind"] == "raise"), None),
                    timeout=LOOP_TIMEOUT,
                    not_yet=not_found,
                )
                raised = raised_entry["maxNumSeqs"]
                # A queue with every slot busy: raised at once, no trial, no verdict.
                assert raised > 2 and raised_entry["action"] == "guard", raised_entry
                assert raised_entry["reason"].startswith("guardrail: queue:"), raised_entry
                dep = wait_for(
                    "a scale-up in the Deployment",
                    lambda: (
                        (d := api.apps.read_namespaced_deployment("chat", api.ns))
                        and d.spec.replicas > 1
                        and d
                    ),
                    timeout=LOOP_TIMEOUT,
                    not_yet=not_found,
                )
            # The server runs what status says is in force (a later raise may have followed).
            kept = api.get("chat")["status"]["tuning"]["maxNumSeqs"]
            assert kept >= raised
            wait_for(
                "the settings in force live on the server",
                lambda: srv.metric(names.MAX_NUM_SEQS_METRIC) == kept,
                timeout=60,
                not_yet=not_found,
            )
            autoscaling = api.get("chat")["status"]["autoscaling"]
            assert dep.spec.replicas == autoscaling["desiredReplicas"] <= 3
            config_map = api.core.read_namespaced_config_map("chat-engine", api.ns)
            assert int(config_map.data["max_num_seqs"]) == kept
            # A tuned max_num_seqs never rolls the pods: one ReplicaSet, scaled.
            wait_for(
                "the scaled pods Ready",
                lambda: api.ready("chat"),
                timeout=LOOP_TIMEOUT,
                not_yet=not_found,
            )
            assert len(replica_sets(api, "chat")) == 1
            st = api.get("chat")["status"]
            assert st["engine"]["maxNumSeqs"] == int(config_map.data["max_num_seqs"])
            row = k8s.run_kubectl("get", "bpis", "chat", "-n", api.ns).stdout.split("\n")[1]
            assert row.split()[3] == str(st["engine"]["maxNumSeqs"])
            reasons = wait_for(
                "Events for both decisions",
                lambda: (
                    (r := events(api, "chat")) and {"TuningGuardrail", "ScaledUp"} <= set(r) and r
                ),
                not_yet=not_found,
            )
            assert reasons["ScaledUp"].startswith("replicas 1 -> "), reasons
            metrics = httpx.get(liveness.replace("/healthz", "/metrics"), timeout=5).text
            assert 'batchpilot_operator_decisions_total{kind="raise",name="chat"' in metrics
            assert 'batchpilot_operator_desired_replicas{name="chat"' in metrics
    finally:
        srv.stop()


def test_thrash_switches_to_fp8_and_rolls_the_deployment(api, tiny_path, tmp_path):
    """A server whose max_num_seqs (64) is far more than its KV cache (1 MiB) holds swaps
    and preempts: with allowFP8KVCache the thrash guardrail switches the KV cache to fp8 at
    once (no trial), which changes the pod template and rolls the Deployment with
    maxUnavailable 0."""
    srv = server(tiny_path, tmp_path, "--max-num-seqs", "64", "--kv-cache-memory", "1MiB")
    spec = {
        "engine": {"maxNumSeqs": 64},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 8, "max": 64}, "cooldownSeconds": 0,
                   "allowFP8KVCache": True, "targetInterTokenLatencySeconds": 60},
    }  # fmt: skip
    try:
        with loop_operator(api, [srv]):
            api.create("thrash", spec)
            start(srv, api, "thrash")
            wait_for("Ready", lambda: api.ready("thrash"), timeout=LOOP_TIMEOUT, not_yet=not_found)
            with load(srv, workers=24, max_tokens=300):
                wait_for(
                    "the fp8 decision in status",
                    lambda: (
                        api.get("thrash").get("status", {}).get("tuning", {}).get("kvCacheDtype")
                        == "fp8"
                    ),
                    timeout=LOOP_TIMEOUT,
                    not_yet=not_found,
                )
            st = wait_for(
                "the rolled generation Ready with fp8",
                lambda: (
                    (s := api.ready("thrash"))
                    and s.get("engine", {}).get("kvCacheDtype") == "fp8"
                    and s
                ),
                timeout=LOOP_TIMEOUT,
                not_yet=not_found,
            )
            fp8 = [h for h in st["tuning"]["history"] if h["kind"] == "fp8"]
            assert fp8 and fp8[0]["action"] == "guard", st["tuning"]
            assert fp8[0]["reason"].startswith("guardrail: KV thrash:"), fp8
            assert st["tuning"].get("experiment") is None, st["tuning"]  # a guardrail has no trial
            dep = api.apps.read_namespaced_deployment("thrash", api.ns)
            args = dep.spec.template.spec.containers[0].args
            assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
            assert dep.spec.strategy.rolling_update.max_unavailable == 0
            wait_for(
                "the old ReplicaSet scaled to 0",
                lambda: replica_sets(api, "thrash") == [0, 1],
                not_yet=not_found,
            )
            assert "fp8" in events(api, "thrash")["TuningGuardrail"]
    finally:
        srv.stop()


def test_hpa_mode_emits_an_hpa_the_api_server_accepts(api, k8s):
    """mode hpa: an autoscaling/v2 HPA on vllm:num_requests_waiting, validated and stored
    by the API server, targets the InferenceService's scale subresource; spec.replicas
    rules the Deployment. Back to builtin, the HPA goes. mode keda without KEDA installed
    is reported, and builds nothing."""
    autoscaling = {"enabled": True, "mode": "hpa", "minReplicas": 1, "maxReplicas": 5,
                   "targetQueueLength": 2.5, "scaleDownStabilizationSeconds": 120}  # fmt: skip
    hpas = client.AutoscalingV2Api(k8s.api)
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens: scrapes fail fast
    with loop_operator(api, [], urls=[unreachable]):
        api.create("chat", {"autoscaling": autoscaling, "replicas": 2})
        st = wait_for("Ready", lambda: api.ready("chat"), timeout=LOOP_TIMEOUT, not_yet=not_found)
        assert st["readyReplicas"] == 2
        hpa = wait_for(
            "the HPA",
            lambda: hpas.read_namespaced_horizontal_pod_autoscaler("chat", api.ns),
            not_yet=not_found,
        )
        assert (hpa.spec.scale_target_ref.kind, hpa.spec.scale_target_ref.name) == (
            "InferenceService",
            "chat",
        )
        assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (1, 5)
        (metric,) = hpa.spec.metrics
        assert metric.external.metric.name == "vllm:num_requests_waiting"
        assert metric.external.target.average_value == "2500m"
        assert hpa.spec.behavior.scale_down.stabilization_window_seconds == 120
        assert hpa.metadata.owner_references[0].kind == "InferenceService"
        # What the HPA controller would do: write spec.replicas through the scale subresource.
        k8s.run_kubectl("scale", "bpis/chat", "--replicas=3", "-n", api.ns)
        wait_for(
            "3 replicas from spec.replicas",
            lambda: api.apps.read_namespaced_deployment("chat", api.ns).spec.replicas == 3,
            not_yet=not_found,
        )
        assert "autoscaling" not in api.get("chat").get("status", {})  # the loop stays out

        api.patch("chat", {"autoscaling": {"mode": "builtin"}})
        wait_for(
            "the HPA deleted",
            lambda: not hpas.list_namespaced_horizontal_pod_autoscaler(api.ns).items,
            not_yet=not_found,
        )

        keda = {**autoscaling, "mode": "keda", "keda": {"serverAddress": "http://prom:9090"}}
        api.create("keda", {"autoscaling": keda})
        degraded = wait_for(
            "Degraded without KEDA",
            lambda: (c := api.condition("keda", "Degraded")).get("status") == "True" and c,
            not_yet=not_found,
        )
        assert degraded["reason"] == "AutoscalerNotServed", degraded
        assert not api.apps.list_namespaced_deployment(
            api.ns, label_selector="batchpilot.dev/service=keda"
        ).items
