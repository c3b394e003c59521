"""The fault at scale (issue 36): kube-apiserver stopped and started again while the
services reconcile. Afterwards every service must have converged with nothing duplicated
or recreated: the Deployments that existed before are the same objects (uid), each has one
ReplicaSet (no rollout) and its replicas' pods, and the operator's own /metrics say what
happened (requests with no answer, watches restarted)."""

from __future__ import annotations

import time
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from batchpilot.operator.children.meta import LABEL_SERVICE

API_REQUESTS = "batchpilot_operator_api_requests_total"
WATCH_RESTARTS = "batchpilot_operator_watch_restarts_total"


def counter_by(metrics_text: str, name: str, label: str) -> dict[str, float]:
    """A counter of the operator's /metrics summed by one label."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels[label]] += sample.value
    return dict(out)


class ApiServerRestart:
    def __init__(self, cluster, api):
        self.cluster, self.api = cluster, api
        self.before: dict[str, str] = {}
        self.down_s = 0.0

    def inject(self, services: int, timeout: float = 300) -> None:
        """Once the operator has made half the services' Deployments (the rest mid-way),
        note them, then stop and start kube-apiserver."""
        deadline = time.monotonic() + timeout
        while len(self.deployments()) < services // 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        self.before = self.deployments()
        t0 = time.monotonic()
        self.cluster.restart("kube-apiserver", timeout=300)
        self.down_s = time.monotonic() - t0

    def deployments(self) -> dict[str, str]:
        items = self.api.apps.list_namespaced_deployment(self.api.ns, _request_timeout=120).items
        return {d.metadata.name: d.metadata.uid for d in items}

    def verdict(self, services: int, replicas: int, operator_metrics: str, alive: bool) -> dict:
        after = self.deployments()
        sets = self.api.apps.list_namespaced_replica_set(self.api.ns, _request_timeout=120).items
        per_deployment = Counter(rs.metadata.owner_references[0].name for rs in sets)
        pods = self.api.core.list_namespaced_pod(self.api.ns, _request_timeout=120).items
        pods_per_service = Counter(p.metadata.labels.get(LABEL_SERVICE) for p in pods)
        recreated = sorted(n for n, uid in self.before.items() if after.get(n) != uid)
        rolled = sorted(n for n, count in per_deployment.items() if count != 1)
        off_count = sorted(n for n in after if pods_per_service.get(n, 0) != replicas)
        return {
            "fault": "kube-apiserver stopped (SIGTERM) and started again once half the "
            "services had their Deployment, the rest mid-reconcile",
            "apiserver_restart_s": round(self.down_s, 1),
            "deployments_before_restart": len(self.before),
            "deployments_after": len(after),
            "all_services_have_a_deployment": len(after) == services,
            "recreated_deployments": recreated,
            "deployments_with_more_than_one_replicaset": rolled,
            "services_with_other_than_their_replicas_pods": off_count[:20],
            "operator_alive": alive,
            "operator_api_requests_by_code": counter_by(operator_metrics, API_REQUESTS, "code"),
            "operator_watch_restarts_by_reason": counter_by(
                operator_metrics, WATCH_RESTARTS, "reason"
            ),
        }


def passed(verdict: dict) -> bool:
    """Converged with nothing recreated, rolled or lost, and the operator lived."""
    return (
        verdict["all_services_have_a_deployment"]
        and verdict["operator_alive"]
        and not verdict["recreated_deployments"]
        and not verdict["deployments_with_more_than_one_replicaset"]
        and not verdict["services_with_other_than_their_replicas_pods"]
    )
