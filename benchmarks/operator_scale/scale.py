"""One point of the curve: a fresh control plane, N InferenceServices of R replicas, the
time until all are Ready, then a steady window in which nothing changes and the operator's
cost, the API load and the loop's cadence are measured."""

from __future__ import annotations

import contextlib
import shutil
import ssl
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import urllib3
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from batchpilot.operator.crd.api import GROUP, PLURAL, VERSION
from benchmarks.operator_scale import faults, measure, processes
from tests.k8s import cluster as k8s_cluster
from tests.support.cluster import Api, install_crds, stop_process

LIST_TIMEOUT = 120  # a LIST of 1,000 services on a loaded 2-core machine
POLL_SECONDS = 5.0  # a third of the loop interval: no turn of a service goes unseen
LOOP_ROUNDS = "batchpilot_operator_loop_rounds_total"
API_REQUESTS = "batchpilot_operator_api_requests_total"
# When each service's latest turn ran: status.metrics.time only moves when the figures are
# written (every --status-interval), so the turns are read from the operator's /metrics.
LAST_ROUND = "batchpilot_operator_loop_last_round_timestamp_seconds"
# Every InferenceService has a ClusterIP Service, and the test cluster's range is a /24
# (254 addresses): at 300 services the API server refused the rest ("range is full").
# The same first address (10.0.0.1, in the serving certificate) with room for 65,534.
SERVICE_CIDR = "10.0.0.0/16"


@dataclass(frozen=True)
class Plan:
    services: int
    replicas: int
    steady_seconds: float
    settle_seconds: float
    ready_timeout: float
    restart_apiserver: bool = False  # the fault: kube-apiserver restarted mid-reconcile
    # kube-controller-manager's and kube-scheduler's client (QPS, burst); None: their
    # defaults (20/30, 50/100), which bound the pods' creation at 1,000 services.
    client_qps: tuple[float, int] | None = None


def service_spec(replicas: int) -> dict:
    """The minimal spec with the builtin autoscaler on, pinned at `replicas` (min = max),
    so the loop's timer runs for it and nothing ever scales."""
    bounds = {"minReplicas": replicas, "maxReplicas": replicas}
    return {"replicas": replicas, "autoscaling": {"enabled": True, **bounds}}


def is_ready(obj: dict) -> bool:
    """As tests/support/cluster.py Api.ready: Ready, not Progressing, this generation."""
    status = obj.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return (
        conditions.get("Ready") == "True"
        and conditions.get("Progressing") == "False"
        and status.get("observedGeneration") == obj["metadata"]["generation"]
    )


def big_node(pods: int) -> dict:
    """A kwok node that holds every pod of the point (fake_node's holds 110)."""
    node = k8s_cluster.fake_node("kwok-bench-0")
    for key in ("capacity", "allocatable"):
        node["status"][key]["pods"] = str(pods)
    return node


class Point:
    def __init__(self, plan: Plan, logs: Path):
        self.plan, self.logs = plan, logs
        self.own_lists = 0  # our LISTs of the services, kept out of the API load
        self.list_failures = 0  # our LISTs the API server answered 5xx while we waited
        self.created_at = 0.0  # wall time of the first create

    def run(self) -> dict:
        k8s_cluster.SERVICE_CIDR = SERVICE_CIDR  # read by start_cluster when it runs
        cluster = k8s_cluster.start_cluster(
            workdir=tempfile.mkdtemp(prefix="bp-scale-"), client_qps=self.plan.client_qps
        )
        try:
            return self._on(cluster)
        finally:
            for name in ("kube-apiserver", "kube-controller-manager", "kwok"):
                log = cluster.log_dir / f"{name}.log"
                if log.exists():
                    shutil.copy(log, self.logs / f"{name}-{self.plan.services}.log")
            cluster.stop()

    def _on(self, cluster) -> dict:
        plan = self.plan
        pods = plan.services * plan.replicas
        status, body = cluster.request("/api/v1/nodes", "POST", big_node(pods + 100))
        if status != 201:
            raise RuntimeError(f"creating the bench node: {body}")
        install_crds(cluster)
        namespace = "scale"
        self.api = Api(cluster, namespace)
        self.api.core.create_namespace(client.V1Namespace(metadata={"name": namespace}))
        wait_for_default_account(self.api)
        ports = [k8s_cluster.free_port() for _ in range(plan.replicas)]
        live_port = k8s_cluster.free_port()
        liveness = f"http://127.0.0.1:{live_port}/healthz"
        self.operator_metrics = f"http://127.0.0.1:{live_port}/metrics"
        n = plan.services
        fakes = processes.start_fake_replicas(ports, self.logs / f"fake-replicas-{n}.log")
        operator = processes.start_operator(
            cluster.env, namespace, ports, liveness, self.logs / f"operator-{n}.log"
        )
        try:
            processes.wait_http_ok(f"http://127.0.0.1:{ports[0]}/metrics", 30, fakes)
            processes.wait_http_ok(liveness, 60, operator)
            with processes.ConnectionWatch(operator.pid) as watch:
                result = self._measure(cluster, operator.pid)
            log = (self.logs / f"operator-{n}.log").read_text().splitlines()
            applied = measure.first_applies(log)
            result["children_applied_all_s"] = (
                round(max(applied.values()) - self.created_at, 1)
                if len(applied) == plan.services
                else None
            )
            result["remote_addresses_seen"] = sorted(watch.remotes)
            result["connection_samples"] = watch.samples
            result["non_loopback_addresses"] = watch.offenders
            result["loopback_only"] = not watch.offenders
            return result
        finally:
            stop_process(operator)
            stop_process(fakes)

    def _measure(self, cluster, pid: int) -> dict:
        plan = self.plan
        requests0 = measure.request_counts(apiserver_metrics(cluster))
        ops0 = operator_requests(processes.http_text(self.operator_metrics))
        lists0 = self.own_lists
        cpu0, t0 = measure.cpu_seconds(pid), time.monotonic()
        self.created_at = time.time()
        for i in range(plan.services):
            self.api.create(f"svc-{i:04d}", service_spec(plan.replicas))
        applied_s = time.monotonic() - t0
        fault = faults.ApiServerRestart(cluster, self.api) if plan.restart_apiserver else None
        if fault is not None:
            fault.inject(plan.services)
        ready_s, peak_rss, times = self._wait_ready(pid, t0)
        reconcile_cpu = (measure.cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        # Every client's requests until all were Ready (kube-controller-manager's pod
        # creates among them), and the operator's own by verb: where the time goes.
        reconciling: dict = {}
        with contextlib.suppress(OSError):  # a figure to explain the time, not to fail on
            after = measure.request_counts(apiserver_metrics(cluster))
            delta = measure.request_delta(requests0, after)
            delta = measure.without(delta, {("LIST", PLURAL, ""): self.own_lists - lists0})
            ops = operator_requests(processes.http_text(self.operator_metrics))
            reconciling = {
                "api_requests_while_reconciling": measure.per_minute_by_request(delta, 60.0),
                "operator_api_requests_while_reconciling": {
                    k: v - ops0.get(k, 0) for k, v in sorted(ops.items()) if v - ops0.get(k, 0)
                },
            }
        time.sleep(plan.settle_seconds)
        steady = self._steady(cluster, pid, times)
        if fault is not None:
            alive = measure.alive(pid)
            metrics = processes.http_text(self.operator_metrics)
            steady["fault"] = fault.verdict(plan.services, plan.replicas, metrics, alive)
        return {
            "services": plan.services,
            "pods": plan.services * plan.replicas,
            "replicas": plan.replicas,
            "apply_s": round(applied_s, 1),
            "reconcile_all_s": None if ready_s is None else round(ready_s, 1),
            "ready_timeout_s": plan.ready_timeout,
            "operator_cpu_cores_while_reconciling": round(reconcile_cpu, 3),
            "operator_peak_rss_mib_while_reconciling": round(peak_rss, 1),
            "own_list_failures_while_reconciling": self.list_failures,
            "settle_s": plan.settle_seconds,
            "control_plane_client_qps": control_plane_qps(plan.client_qps),
            **reconciling,
            **steady,
        }

    def _record_turns(self, times: dict[str, set[float]]) -> None:
        # A busy operator late to answer: the next poll sees the turns it ran.
        with contextlib.suppress(OSError):
            record_turns(processes.http_text(self.operator_metrics), times)

    def _list(self) -> list[dict]:
        self.own_lists += 1
        return self.api.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.api.ns, PLURAL, _request_timeout=LIST_TIMEOUT
        )["items"]

    def _wait_ready(self, pid: int, t0: float) -> tuple[float | None, float, dict]:
        """Seconds from the first create to all Ready (None: not within the timeout), the
        peak RSS meanwhile, and the turn times seen so far by service."""
        peak, times = 0.0, {}
        while time.monotonic() - t0 < self.plan.ready_timeout:
            try:
                items = self._list()
            except client.ApiException as e:
                # A loaded API server times our LIST out (a 504 after its 60 s): ask again.
                if e.status is None or e.status < 500:
                    raise
                self.list_failures += 1
                continue
            except (urllib3.exceptions.HTTPError, OSError):
                # A loaded API server cut a 1,000-object answer short (IncompleteRead, seen
                # at load 12): ask again, as for a 5xx.
                self.list_failures += 1
                continue
            peak = max(peak, measure.rss_mib(pid))
            self._record_turns(times)
            ready = sum(is_ready(o) for o in items)
            if ready == self.plan.services:
                return time.monotonic() - t0, peak, times
            time.sleep(2)
        return None, peak, times

    def _steady(self, cluster, pid: int, times: dict) -> dict:
        plan = self.plan
        rounds0 = loop_rounds(processes.http_text(self.operator_metrics))
        before = measure.request_counts(apiserver_metrics(cluster))
        lists0, cpu0 = self.own_lists, measure.cpu_seconds(pid)
        start_wall, start = time.time(), time.monotonic()
        rss = []
        while time.monotonic() - start < plan.steady_seconds:
            self._record_turns(times)
            rss.append(measure.rss_mib(pid))
            time.sleep(POLL_SECONDS)
        # One more look after the window: a turn just before its end is seen.
        self._record_turns(times)
        seconds = time.monotonic() - start
        cpu = measure.cpu_seconds(pid) - cpu0
        after = measure.request_counts(apiserver_metrics(cluster))
        rounds = loop_rounds(processes.http_text(self.operator_metrics))
        delta = measure.request_delta(before, after)
        own = {("LIST", PLURAL, ""): self.own_lists - lists0, ("GET", "", ""): 1}
        delta = measure.without(delta, own)
        end_wall = start_wall + seconds
        gaps = [measure.turn_gaps(times.get(f"svc-{i:04d}", ()), start_wall, end_wall)
                for i in range(plan.services)]  # fmt: skip
        minutes = seconds / 60
        status_writes = delta.get(("PATCH", PLURAL, "status"), 0)
        turns_per_min = [(rounds.get(k, 0) - rounds0.get(k, 0)) / minutes for k in rounds]
        return {
            "steady_window_s": round(seconds, 1),
            "operator_rss_mib": round(max(rss), 1),
            "operator_cpu_cores": round(cpu / seconds, 3),
            "api_requests_per_min": measure.per_minute_by_verb(delta, seconds),
            "api_requests_per_min_by_resource": measure.per_minute_by_request(delta, seconds),
            "api_requests_excluded": "the benchmark's own LISTs of inferenceservices and "
            "its GET of /metrics; the rest is every client's (operator, kcm, scheduler, kwok)",
            "steady_writes_per_service_per_min": round(status_writes / plan.services / minutes, 2),
            "steady_object_patches_per_service_per_min": round(
                delta.get(("PATCH", PLURAL, ""), 0) / plan.services / minutes, 2
            ),
            "max_observe_gap_s": round(max(gaps), 1),
            "observe_gap_p50_s": round(measure.percentile(gaps, 50), 1),
            "observe_gap_p99_s": round(measure.percentile(gaps, 99), 1),
            "services_observed_in_window": sum(g < seconds for g in gaps),
            "loop_rounds_per_service_per_min_p50": round(
                measure.percentile(turns_per_min, 50), 2
            ) if turns_per_min else None,
        }  # fmt: skip


def control_plane_qps(client_qps: tuple[float, int] | None) -> dict:
    """kube-controller-manager's and kube-scheduler's client limits, as the point ran."""
    if client_qps is None:
        return {"setting": "default", "kube-controller-manager": {"qps": 20, "burst": 30},
                "kube-scheduler": {"qps": 50, "burst": 100}}  # fmt: skip
    qps, burst = client_qps
    raised = {"qps": qps, "burst": burst}
    return {"setting": "raised", "kube-controller-manager": raised, "kube-scheduler": raised}


def operator_requests(metrics_text: str) -> dict[str, float]:
    """The operator's own API requests (batchpilot_operator_api_requests_total), by
    "verb code"."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == API_REQUESTS:
                key = " ".join(sample.labels.get(k, "") for k in ("verb", "code"))
                counts[key] = counts.get(key, 0) + sample.value
    return counts


def record_turns(metrics_text: str, times: dict[str, set[float]]) -> None:
    """Add each service's latest turn, from the operator's /metrics, to its turn times."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == LAST_ROUND:
                times.setdefault(sample.labels["name"], set()).add(sample.value)


def loop_rounds(metrics_text: str) -> dict[str, float]:
    """The operator's own round counter by service name."""
    rounds = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == LOOP_ROUNDS:
                rounds[sample.labels["name"]] = sample.value
    return rounds


def apiserver_metrics(cluster) -> str:
    """The API server's /metrics, as its admin (cluster.request's 5 s is too short for a
    loaded server's whole exposition)."""
    context = ssl.create_default_context(cafile=cluster.ca_file)
    headers = {"Authorization": f"Bearer {cluster.token}"}
    request = urllib.request.Request(cluster.server + "/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=60, context=context) as resp:
        return resp.read().decode()


def wait_for_default_account(api: Api) -> None:
    """Pods cannot be made before the namespace's `default` ServiceAccount exists."""
    deadline = time.monotonic() + 60
    while True:
        try:
            api.core.read_namespaced_service_account("default", api.ns)
            return
        except client.ApiException as e:
            if e.status != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
