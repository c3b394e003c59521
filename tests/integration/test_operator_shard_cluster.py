"""Two operator processes, --shard 0/2 and 1/2, on one namespace of the loopback control
plane: every InferenceService is reconciled by the shard its name hashes to and by no
other, has one set of children, and is deleted while its shard runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpilot.operator.crd.api import GROUP, PLURAL, VERSION
from batchpilot.operator.shard import shard_of
from tests.support.cluster import (
    PROCESS_TIMEOUT,
    not_found,
    start_operator_process,
    stop_process,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster

SERVICES = [f"svc-{i}" for i in range(8)]


def objects(log: Path, message: str = "") -> set[str]:
    """The services whose objects this process logged about (its JSON log's object refs:
    a child is named after its service, or its service's name and a suffix), for messages
    starting so."""
    names = set()
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if "object" in entry and entry.get("message", "").startswith(message):
            name = entry["object"]["name"]
            names |= {s for s in SERVICES if name == s or name.startswith(f"{s}-")}
    return names


def test_two_shards_reconcile_each_service_exactly_once(api, k8s, tmp_path):
    logs = [tmp_path / f"shard-{i}.log" for i in range(2)]
    expected = [{n for n in SERVICES if shard_of(api.ns, n, 2) == i} for i in range(2)]
    assert all(expected), "eight names that all hash to one shard: pick others"
    procs = [
        start_operator_process(k8s, api.ns, "--standalone", "--shard", f"{i}/2", log=log)
        for i, log in enumerate(logs)
    ]
    try:
        for name in SERVICES:
            api.create(name, {})
        for name in SERVICES:
            wait_for(f"{name} Ready", lambda n=name: api.ready(n), PROCESS_TIMEOUT,
                     not_yet=not_found)  # fmt: skip
        for i, log in enumerate(logs):
            # It applied its own services' children, and no handler of it (reconcile,
            # timers, child events) ran for another shard's.
            assert objects(log, "Applied generation") == expected[i]
            assert objects(log) == expected[i]
        for name in SERVICES:
            deployments = api.apps.list_namespaced_deployment(
                api.ns, label_selector=f"batchpilot.dev/service={name}"
            ).items
            assert len(deployments) == 1
        for name in SERVICES:
            api.delete(name)
        wait_for(
            "every service deleted through its shard's finalizer",
            lambda: (
                not api.custom.list_namespaced_custom_object(GROUP, VERSION, api.ns, PLURAL)[
                    "items"
                ]
            ),
            PROCESS_TIMEOUT,
            not_yet=not_found,
        )
    except AssertionError as e:
        tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
        raise AssertionError(f"{e}\n{tails}") from None
    finally:
        for proc in procs:
            stop_process(proc)
