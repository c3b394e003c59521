"""The operator through kube-apiserver outages, on a control plane of its own (the
session's shared one must not go down under other tests): started while the API server is
down, it waits and then serves; services created before, during and after a restart all
converge, none twice, no child is deleted or recreated, the process lives through it, and
its /metrics and log say what happened (failed requests, watches restarted on 410 Gone)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client

from benchmarks.operator_scale.faults import counter_by
from tests.k8s import cluster as k8s_cluster
from tests.support.cluster import (
    PROCESS_TIMEOUT,
    Api,
    free_port,
    install_crds,
    not_found,
    start_operator_process,
    stop_process,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster

NAMESPACE = "restart"
BEFORE, AFTER = [f"before-{i}" for i in range(12)], [f"after-{i}" for i in range(6)]


def deployments(api: Api) -> dict[str, str]:
    """name -> uid of the operator's Deployments in the namespace."""
    items = api.apps.list_namespaced_deployment(api.ns).items
    return {d.metadata.name: d.metadata.uid for d in items}


def resynced(log: Path, offset: int) -> set[str]:
    """The services whose resync timer succeeded in the log past ``offset`` (JSON lines)."""
    names = set()
    for line in log.read_text()[offset:].splitlines():
        if line.startswith("{") and "Timer 'resync' succeeded" in line:
            names.add(json.loads(line)["object"]["name"])
    return names


def operator_counts(metrics_url: str, name: str, label: str) -> dict[str, float]:
    """A counter of the operator's /metrics, summed by one label."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        return counter_by(resp.read().decode(), name, label)


def all_ready(api: Api, names: list[str]) -> bool:
    return all(api.ready(n) for n in names)


def test_the_operator_converges_through_api_server_restarts_with_nothing_recreated(tmp_path: Path):
    k8s = k8s_cluster.start_cluster()
    log = tmp_path / "operator.log"
    operator = None
    try:
        install_crds(k8s)
        client.CoreV1Api(k8s.api).create_namespace({"metadata": {"name": NAMESPACE}})
        api = Api(k8s, NAMESPACE)
        # The operator starts while kube-apiserver is down: it waits for it to serve what
        # the operator watches (kopf would otherwise keep an incomplete discovery).
        k8s.component("kube-apiserver").stop()
        port = free_port()
        metrics = f"http://127.0.0.1:{port}/metrics"
        # --verbose: the log keeps kopf's "Timer 'resync' succeeded" lines read below.
        liveness = ("--verbose", "--liveness", f"http://127.0.0.1:{port}/healthz")
        operator = start_operator_process(k8s, NAMESPACE, "--standalone", *liveness, log=log)
        wait_for("the operator to wait for the API server",
                 lambda: "waiting for the API server" in log.read_text(), PROCESS_TIMEOUT,
                 not_yet=not_found)  # fmt: skip
        k8s.start_component("kube-apiserver")
        api.create(BEFORE[0], {})
        wait_for("the first service Ready", lambda: api.ready(BEFORE[0]), PROCESS_TIMEOUT,
                 not_yet=not_found)  # fmt: skip
        for name in BEFORE[1:]:
            api.create(name, {})
        # Mid-reconcile: some children exist, some not yet; watches and requests break.
        created = deployments(api)
        k8s.restart("kube-apiserver")
        for name in AFTER:
            api.create(name, {})
        wait_for("every service Ready", lambda: all_ready(api, BEFORE + AFTER),
                 PROCESS_TIMEOUT, not_yet=not_found)  # fmt: skip
        converged = deployments(api)
        assert sorted(converged) == sorted(BEFORE + AFTER)
        # What existed before the restart is the same object after it.
        assert {n: converged[n] for n in created} == created
        # A restart in the steady state: every service is reconciled again after it (its
        # resync timer), and every child stays as it is. A write just before it moves the
        # store past every watch's last event: each watch resumes from a version the new
        # API server's cache does not hold, and gets 410 Gone.
        restarts = "batchpilot_operator_watch_restarts_total"
        expired = operator_counts(metrics, restarts, "reason").get("expired", 0)
        client.CoreV1Api(k8s.api).create_namespace({"metadata": {"name": "moves-the-store"}})
        before_restart = len(log.read_text())
        k8s.restart("kube-apiserver")
        offset = len(log.read_text())
        wait_for("a resync of every service after the restart",
                 lambda: resynced(log, offset) >= set(BEFORE + AFTER), PROCESS_TIMEOUT,
                 not_yet=not_found)  # fmt: skip
        assert all_ready(api, BEFORE + AFTER)
        assert deployments(api) == converged
        assert operator.poll() is None, log.read_text()[-3000:]
        # What happened, in the operator's own words: requests that got no answer, and
        # watches started again from a fresh list.
        requests = operator_counts(metrics, "batchpilot_operator_api_requests_total", "code")
        assert requests.get("error", 0) > 0, requests
        wait_for("the watches' 410 Gone counted",
                 lambda: operator_counts(metrics, restarts, "reason").get("expired", 0) > expired,
                 PROCESS_TIMEOUT)  # fmt: skip
        assert "Restarting the watch-stream" in log.read_text()[before_restart:]
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- operator log\n{log.read_text()[-4000:]}") from None
    finally:
        if operator is not None:
            stop_process(operator)
        k8s.stop()
