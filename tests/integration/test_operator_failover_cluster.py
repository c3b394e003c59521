"""High availability with real processes: two operator replicas peer, the active one is
killed (SIGKILL: no goodbye) while a change is under its no-harm test on a real server, and
the standby takes over within 30 s, reads the test from status and ends it, with no second
trial of the same decision and no child recreated."""

from __future__ import annotations

import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.support.cluster import (
    LOOP_TIMEOUT,
    Api,
    load,
    not_found,
    server,
    start,
    start_operator_process,
    stop_process,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.cluster

PEERING = "batchpilot"
LIFETIME = 10  # --peering-lifetime: how long the standby waits for a silent peer
# A verdict comes within verify.MAX_SECONDS (600) of the trial's start, by design.
VERDICT_TIMEOUT = 700


def tuning(api: Api, name: str) -> dict:
    return (api.get(name).get("status") or {}).get("tuning") or {}


def peers(api: Api) -> int:
    obj = api.custom.get_namespaced_custom_object("kopf.dev", "v1", api.ns, "kopfpeerings", PEERING)
    return len(obj.get("status") or {})


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def peer(k8s, api: Api, srv, priority: int, log: Path):
    env = {
        "BATCHPILOT_METRICS_URLS": srv.url,
        "BATCHPILOT_ADMIN_URLS": srv.admin_url,
        "BATCHPILOT_LOOP_INTERVAL": "2",
    }
    args = ("--peering", PEERING, "--priority", str(priority), "--peering-lifetime",
            str(LIFETIME), "--log-format", "plain")  # fmt: skip
    return start_operator_process(k8s, api.ns, *args, log=log, env=env)


def test_cli_process_failover_after_a_crash_mid_experiment(api, k8s, tiny_path, tmp_path):
    api.custom.create_namespaced_custom_object(
        "kopf.dev", "v1", api.ns, "kopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}},
    )  # fmt: skip
    # Far more slots (64) than a 1 MiB KV cache holds: the thrash guardrail tests a lower
    # at once (no fp8 allowed), and the test runs on the server while it is under way.
    srv = server(tiny_path, tmp_path, "--max-num-seqs", "64", "--kv-cache-memory", "1MiB")
    spec = {
        "engine": {"maxNumSeqs": 64},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 8, "max": 64}, "cooldownSeconds": 0,
                   "targetInterTokenLatencySeconds": 60},
    }  # fmt: skip
    logs = {"active": tmp_path / "active.log", "standby": tmp_path / "standby.log"}
    active = peer(k8s, api, srv, 100, logs["active"])
    standby = peer(k8s, api, srv, 10, logs["standby"])
    try:
        wait_for("both replicas in the peering", lambda: peers(api) == 2, LOOP_TIMEOUT,
                 not_yet=not_found)  # fmt: skip
        api.create("chat", spec)
        start(srv, api, "chat")
        wait_for("Ready", lambda: api.ready("chat"), LOOP_TIMEOUT, not_yet=not_found)
        deployment = api.apps.read_namespaced_deployment("chat", api.ns).metadata.uid
        with load(srv, workers=24, max_tokens=300):
            trial = wait_for(
                "a lower under test",
                lambda: (t := tuning(api, "chat")).get("experiment") and t,
                LOOP_TIMEOUT,
                not_yet=not_found,
            )
            before = logs["standby"].read_text()
            # It stands by: it never resumed (kopf starts it paused under a mandatory
            # peering), or its last word on the peering is a pause (it may resume for a
            # moment at start-up, before it sees the active one).
            assert before.rfind("Pausing operations") >= before.rfind("Resuming operations")
            killed, killed_at = time.monotonic(), datetime.now(UTC)
            active.send_signal(signal.SIGKILL)
            active.wait(10)
            wait_for(
                "the standby to take over",
                lambda: "Resuming operations" in logs["standby"].read_text()[len(before) :],
                60,
                not_yet=not_found,
            )
            takeover = time.monotonic() - killed
            ended = wait_for(
                "the standby's verdict on the trial",
                lambda: (t := tuning(api, "chat")).get("experiment") is None and t,
                VERDICT_TIMEOUT,
                not_yet=not_found,
            )
    except AssertionError as e:
        tails = "\n".join(f"--- {k}\n{p.read_text()[-3000:]}" for k, p in logs.items())
        raise AssertionError(f"{e}\n{tails}") from None
    finally:
        stop_process(active)
        stop_process(standby)
        srv.stop()
    print(f"failover: the standby resumed {takeover:.1f} s after the kill")
    assert takeover <= 30, takeover
    started = trial["experiment"]
    history = ended["history"]
    tries = [i for i, h in enumerate(history) if h["action"] in ("try", "canary")]
    first = tries[0]
    assert history[first]["kind"] == started["kind"] == "lower", history
    # What ends it comes next, nothing tried the same decision again first: its verdict, or
    # a queue guardrail's raise, which abandons a test at once.
    end = history[first + 1]
    if end["action"] == "guard":
        assert "(the test of lower was abandoned)" in end["reason"], history
    else:
        assert end["action"] in ("keep", "revert", "abandon") and end["kind"] == "lower", history
    # The standby carried the test: the trial began before the kill, ended after it.
    assert parse_time(history[first]["time"]) < killed_at < parse_time(end["time"])
    assert api.apps.read_namespaced_deployment("chat", api.ns).metadata.uid == deployment
