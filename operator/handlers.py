"""Thin kopf handlers: the operator's settings and the registrations that call the
reconcile (reconcile.py) and the loop's timer (loop/timer.py).

Handlers are built per config by ``make_registry(config)``: ``batchpilot operator`` passes
the registry to ``kopf.run``; tests pass it to ``kopf.testing.KopfRunner``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from batchpilot.operator import probes
from batchpilot.operator.children.meta import LABEL_MANAGED_BY, MANAGED_BY, MANAGED_SELECTOR
from batchpilot.operator.config import FIELD_MANAGER, FINALIZER, OperatorConfig
from batchpilot.operator.crd.api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from batchpilot.operator.kube import load_configuration
from batchpilot.operator.loop.idle import WAKE_ANNOTATION
from batchpilot.operator.loop.timer import LoopTimer, adapters_wanted, loop_wanted
from batchpilot.operator.model_cache import settled
from batchpilot.operator.reconcile import Reconciler, controller_owner
from batchpilot.operator.shard import Shard


def plain(body: Any) -> dict:
    """A kopf Body (a live view) as a plain, detached dict."""
    return json.loads(
        json.dumps(body, default=lambda o: dict(o) if isinstance(o, Mapping) else str(o))
    )


# What the handlers watch: served before kopf starts (kube.wait_until_served).
WATCHED_KINDS = [
    (API_VERSION, KIND),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("policy/v1", "PodDisruptionBudget"),
    ("batch/v1", "Job"),
]


def configure_settings(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    # Watches: the server ends each watch cleanly before the client gives up on it, a dead
    # connection is noticed by the client timeout, and reconnects back off a little.
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.watching.connect_timeout = 10
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    # Children are watched through a server-side label selector: only the operator's own.
    for resource in (
        ("apps", "deployments"),
        "services",
        "configmaps",
        ("policy", "poddisruptionbudgets"),
        ("batch", "jobs"),
    ):
        settings.watching.label_selectors[resource] = MANAGED_SELECTOR
    # Kopf's bookkeeping lives in batchpilot.dev annotations, never in our status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Only timers need a finalizer (deletion is left to owner references): name it.
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # no "handler succeeded" event noise
    settings.posting.reporting_component = FIELD_MANAGER
    settings.execution.max_workers = 16
    settings.peering.stealth = True
    settings.peering.lifetime = config.peering_lifetime


def connection_info(c: Any, settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """Kopf's credentials from the same client configuration the handlers use."""
    header = c.get_api_key_with_prefix("BearerToken") or c.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=c.host,
        ca_path=c.ssl_ca_cert,
        insecure=not c.verify_ssl,
        username=c.username or None,
        password=c.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=c.cert_file,
        private_key_path=c.key_file,
        trust_env=settings.networking.trust_env,
    )


def make_registry(
    config: OperatorConfig, reconciler: Reconciler | None = None, timer: LoopTimer | None = None
) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    rec = reconciler or Reconciler(config)
    _register_operator(registry, config)
    shard = Shard.parse(config.shard)
    _register_inference_services(registry, config, rec, timer or LoopTimer(config, rec), shard)
    _register_children(registry, rec, shard)
    return registry


def _register_operator(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Settings, credentials, and the liveness and metrics endpoint."""
    endpoint: list[Any] = []  # the running HTTP server, if any

    @kopf.on.startup(id="configure", registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_settings(settings, config)
        if config.liveness:
            endpoint.append(await probes.serve(config.liveness))

    @kopf.on.cleanup(id="probes", registry=registry)
    async def cleanup(**_: Any) -> None:
        while endpoint:
            await endpoint.pop().cleanup()

    @kopf.on.login(id="login", registry=registry)
    def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
        return connection_info(load_configuration(), settings)


def _register_inference_services(
    registry: kopf.OperatorRegistry,
    config: OperatorConfig,
    rec: Reconciler,
    timer: LoopTimer,
    shard: Shard,
) -> None:
    """Every handler sees only this shard's services: another shard's get no finalizer,
    no reconcile and no loop turn from this process."""

    def ours(namespace: str, name: str, **_: Any) -> bool:
        return shard.owns(namespace, name)

    isvc = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)
    mine = dict(**isvc, when=ours)

    @kopf.on.resume(**mine, id="reconcile", backoff=5)
    @kopf.on.create(**mine, id="reconcile", backoff=5)
    @kopf.on.update(**mine, id="reconcile", backoff=5)
    def on_change(reason: str, body: kopf.Body, logger: Any, **_: Any) -> None:
        if reason == kopf.Reason.CREATE:  # maybe a replay (Reconciler.create_by_name)
            return rec.create_by_name(plain(body), logger)
        rec.reconcile_by_name(body.metadata.namespace, body.metadata.name, logger)

    @kopf.timer(
        **isvc,
        id="resync",
        when=ours,
        interval=config.reconcile_interval,
        initial_delay=config.reconcile_interval,
        backoff=5,
    )
    def resync(body: kopf.Body, namespace: str, name: str, logger: Any, **_: Any) -> None:
        rec.resync_by_name(namespace, name, plain(body), logger)

    @kopf.timer(
        **isvc,
        id="loop",
        interval=config.loop_interval,
        backoff=config.loop_interval,
        when=kopf.all_([ours, lambda spec, **_: loop_wanted(spec)]),
    )
    async def loop(body: kopf.Body, logger: Any, **_: Any) -> None:
        await timer.tick(plain(body), logger)

    # The activator's wake request runs a loop turn at once, not at the next timer tick: a
    # request is waiting on it. A watch-event handler, not a field handler: kopf leaves the
    # annotations under its own storage's prefix (batchpilot.dev/) out of what it diffs, so
    # a field handler on this one never ran, and every wake waited for the timer.
    @kopf.on.event(**mine, id="wake", annotations={WAKE_ANNOTATION: kopf.PRESENT})
    async def wake(type: str | None, body: kopf.Body, logger: Any, **_: Any) -> None:
        if timer.wake_is_new(plain(body), listed=type is None):
            await timer.tick(plain(body), logger)

    _register_adapters(isvc, mine, ours, config, timer)

    # optional: no finalizer of its own (the timers' one is there anyway).
    @kopf.on.delete(**mine, id="forget", optional=True)
    def forget(namespace: str, name: str, **_: Any) -> None:
        timer.forget(namespace, name)


def _register_adapters(isvc: dict, mine: dict, ours: Any, config: OperatorConfig,
                       timer: LoopTimer) -> None:  # fmt: skip
    # Adapters load into each Ready replica through its admin API, whatever the loop does;
    # a change of spec.adapters runs a turn at once.
    @kopf.timer(
        **isvc,
        id="adapters",
        interval=config.loop_interval,
        backoff=config.loop_interval,
        when=kopf.all_([ours, lambda spec, status, **_: adapters_wanted(spec, status)]),
    )
    async def adapters(body: kopf.Body, logger: Any, **_: Any) -> None:
        await timer.sync_adapters(plain(body), logger)

    @kopf.on.field(**mine, id="adapters-changed", field=("spec", "adapters"))
    async def adapters_changed(body: kopf.Body, logger: Any, **_: Any) -> None:
        await timer.sync_adapters(plain(body), logger)


def _register_children(registry: kopf.OperatorRegistry, rec: Reconciler, shard: Shard) -> None:
    def ours(body: kopf.Body, **_: Any) -> bool:
        owner = controller_owner(body)
        return owner is not None and shard.owns(*owner)

    child = dict(labels={LABEL_MANAGED_BY: MANAGED_BY}, registry=registry, when=ours)

    @kopf.on.event("apps", "v1", "deployments", id="deployment", **child)
    def deployment_event(event: dict, body: kopf.Body, logger: Any, **_: Any) -> None:
        rec.on_deployment_event(event.get("type"), plain(body), logger)

    @kopf.on.event("", "v1", "services", id="child", **child)
    @kopf.on.event("", "v1", "configmaps", id="child", **child)
    @kopf.on.event("policy", "v1", "poddisruptionbudgets", id="child", **child)
    def child_event(event: dict, body: kopf.Body, logger: Any, **_: Any) -> None:
        rec.on_child_event(event.get("type"), plain(body), logger)

    # A model cache's fill Job that finished starts the pods (or marks the service Degraded).
    @kopf.on.event("batch", "v1", "jobs", id="model-cache", **child)
    def job_event(event: dict, body: kopf.Body, logger: Any, **_: Any) -> None:
        job = plain(body)
        owner = controller_owner(job)
        if owner is not None and settled(event.get("type"), job):
            rec.reconcile_by_name(*owner, logger)
