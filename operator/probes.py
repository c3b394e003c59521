"""The operator's own HTTP endpoint: liveness and its Prometheus metrics on one port.

It replaces kopf's liveness server, which serves one path only. /healthz answers 200 while
the operator's event loop runs; /metrics exposes what the closed loop decides.
"""

from __future__ import annotations

import urllib.parse

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

# A registry of its own: the operator's metrics only, even when a test runs a server's
# metrics in the same process.
REGISTRY = CollectorRegistry()
DECISIONS = Counter(
    "batchpilot_operator_decisions",
    "Closed-loop decisions per InferenceService: kind is the change (raise, lower, "
    "raise_budget, lower_budget, fp8, fp8_off, scale_up, scale_down) and outcome what "
    "became of it (try, canary, keep, rollout, revert, abandon; apply for scaling)",
    ["namespace", "name", "kind", "outcome"],
    registry=REGISTRY,
)
APPLY_FAILURES = Counter(
    "batchpilot_operator_apply_failures",
    "Live setting changes a replica refused or did not answer",
    ["namespace", "name"],
    registry=REGISTRY,
)
LOOP_BLIND = Gauge(
    "batchpilot_operator_loop_blind",
    "1 while too few replicas answer their scrape for the loop to decide anything",
    ["namespace", "name"],
    registry=REGISTRY,
)
SCRAPE_FAILURES = Counter(
    "batchpilot_operator_scrape_failures",
    "Replica /metrics scrapes that got no answer or a non-200 one",
    ["namespace", "name"],
    registry=REGISTRY,
)
DESIRED_REPLICAS = Gauge(
    "batchpilot_operator_desired_replicas",
    "Replicas the built-in autoscaler wants, per InferenceService",
    ["namespace", "name"],
    registry=REGISTRY,
)
# The tuner's model of one replica, for an HPA or KEDA to scale on (autoscaling.mode hpa or
# keda): arrivals over 0.8 x this capacity is the replica count the loop's own scaler aims at.
REPLICA_CAPACITY = Gauge(
    "batchpilot_operator_replica_capacity_requests_per_second",
    "Requests per second one replica completes within the SLO at the settings in force (the tuner's model)",
    ["namespace", "name"],
    registry=REGISTRY,
)
LOOP_ROUNDS = Counter(
    "batchpilot_operator_loop_rounds",
    "Closed-loop rounds run, per InferenceService",
    ["namespace", "name"],
    registry=REGISTRY,
)
# Alert on time() minus this: a service whose loop stopped turning (an operator that fell
# behind, a stuck turn) shows here first.
LOOP_LAST_ROUND = Gauge(
    "batchpilot_operator_loop_last_round_timestamp_seconds",
    "Unix time of the latest closed-loop round, per InferenceService",
    ["namespace", "name"],
    registry=REGISTRY,
)

# Like client-go's rest_client_requests_total: the load the operator puts on the API
# server, and its failures (an API server restart shows as "error" and 5xx codes).
API_REQUESTS = Counter(
    "batchpilot_operator_api_requests",
    "Kubernetes API requests the reconciler and the loop made, by verb and HTTP status "
    "(error: no answer)",
    ["verb", "code"],
    registry=REGISTRY,
)
WATCH_RESTARTS = Counter(
    "batchpilot_operator_watch_restarts",
    "Watch streams started again from a fresh list: expired (410 Gone: the resource "
    "version was compacted away) or inactive (no event within the inactivity timeout)",
    ["resource", "reason"],
    registry=REGISTRY,
)


async def _health(_: web.Request) -> web.Response:
    return web.json_response({})


async def _metrics(_: web.Request) -> web.Response:
    body = generate_latest(REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(endpoint: str) -> web.AppRunner:
    """Serve the liveness path of ``endpoint`` (http://host:port/path) and /metrics."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme != "http":
        raise ValueError(f"liveness endpoint must be http://host:port/path, not {endpoint!r}")
    app = web.Application()
    app.add_routes([web.get(parts.path or "/healthz", _health), web.get("/metrics", _metrics)])
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname or "localhost", parts.port or 80).start()
    return runner
