"""The loop v3's no-harm test on real pods: a planned change runs first on one replica chosen
at random (the canary) and is judged against the other replica over the same window; one is
kept and rolled out, one is reverted. Each is visible in status.tuning (the experiment and
its canary, the history) and in the InferenceService's Events, and each reaches what the
pods' batchpilot:max_num_seqs reports.

Two InferenceServices of two replicas each, autoscaling off, max_num_seqs 16 in 1..16, a
KV cache of 64 MiB (90 blocks of 16 tokens at float32, about 10 of the load's sequences
at the planner's 85 %). Poisson arrivals at RATE a second on each pod, each pod behind its
own NodePort so that both arms get the same load. Once the model has learned, its plan is
a KV lower (16 is more than the cache holds): planned, tried on a canary.

The load is open, well under a replica's capacity, so that both arms get the same arrivals
however fast each serves them (a closed loop would send a slowed canary fewer requests).

(a) kept: nothing else differs, so the canary's SLO attainment is no worse than the
    control's (non-inferiority at 5 %) and its steps no slower; the lower rolls out.
(b) reverted: the second service's canary gets two busy loops in its own container, as a
    change that slows the replica would; its steps at matched batch sizes run well over
    1.25x the control's, so the test fails and the canary goes back to 16.

The second service idles (no load, so no plan) while the first is tested: one at a time
on this 2-core machine. The dwell after a change (600 s) would keep one service from a
second planned change within a CI run.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.kind import POLL, Kind, cpu_sample, teardown, wait_ready
from tests.support.kind_tuning import (
    answers,
    dump,
    events,
    load_logs,
    node_port,
    pod_max_num_seqs,
    server_pods,
    start_load,
    stop_load,
    tuning_status,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.kind

KEEP, REVERT = "smol-keep", "smol-revert"
START_MNS = 16
OUTPUT, PROMPT_REPEATS = 32, 20
RATE = 0.5  # requests a second on each pod: about 0.6 of its capacity at batch 2 on this CPU
ARM_LABEL = "batchpilot-test/arm"
# The plan needs a fitted model and 30 s of demand (under a minute of load on a quiet
# machine); a PlantDegraded freeze from a neighbour holds it up to SETTLE_SECONDS more.
TRIAL_TIMEOUT = 900
# A verdict comes within verify.MAX_SECONDS (600) of the trial's start, by design.
VERDICT_TIMEOUT = 700
HOGS = 2  # busy loops in the canary's container: its server keeps about a third of a core
HOG_SECONDS = 400


def canary_sample(namespace: str, name: str) -> dict:
    sample = cpu_sample(namespace, name)
    spec = sample["spec"]
    spec["replicas"] = 2
    spec["engine"]["maxNumSeqs"] = START_MNS
    spec["engine"]["maxModelLen"] = 512
    spec["engine"]["extraArgs"] = ["--kv-cache-memory", "64MiB"]
    spec["autoscaling"] = {"enabled": False}
    spec["tuning"] = {"enabled": True, "maxNumSeqs": {"min": 1, "max": 16}}
    # Targets every pod meets: a verdict on the canary reads its SLO attainment and step
    # time against the control's, and no latency guardrail acts.
    spec["slo"] = {"timeToFirstTokenSeconds": 600, "interTokenLatencySeconds": 30}
    return sample


@pytest.fixture(scope="module")
def services(kind: Kind, namespace: str, operator, report) -> Iterator[None]:
    kind.apply(canary_sample(namespace, KEEP), canary_sample(namespace, REVERT))
    for name in (KEEP, REVERT):
        wait_ready(kind, namespace, report, replicas=2, name=name)
    yield
    teardown(kind, namespace)


def pod_urls(kind: Kind, namespace: str, name: str, report) -> dict[str, str]:
    """Each Ready pod of ``name`` behind a NodePort of its own: pod name -> URL."""
    try:
        pods = wait_for(f"two Ready pods of {name}",
                        lambda: p if len(p := server_pods(kind, namespace, name)) == 2 else None,
                        300, interval=POLL)  # fmt: skip
    except AssertionError as e:
        report(str(e))
    urls = {}
    for pod in pods:
        pod_name = pod["metadata"]["name"]
        kind.kubectl("label", "pod", "-n", namespace, pod_name, f"{ARM_LABEL}={pod_name}",
                     "--overwrite")  # fmt: skip
        selector = {"batchpilot.dev/service": name, ARM_LABEL: pod_name}
        urls[pod_name] = node_port(kind, namespace, pod_name, selector)
    for url in urls.values():
        try:
            wait_for(f"{url} to answer", lambda u=url: answers(u), 120, interval=POLL)
        except AssertionError as e:
            report(str(e))
    return urls


@contextmanager
def loaded(kind: Kind, namespace: str, name: str, tmp_path: Path, report) -> Iterator[dict]:
    """Poisson arrivals at RATE on each pod of ``name`` while the block runs; yields the
    pods' URLs by pod name."""
    urls = pod_urls(kind, namespace, name, report)
    loads = [
        start_load(url, tmp_path / f"load-{pod}.json", OUTPUT, PROMPT_REPEATS, rate=RATE)
        for pod, url in urls.items()
    ]
    try:
        yield urls
    finally:
        for load in loads:
            stop_load(load)


def wait_events(kind: Kind, namespace: str, name: str, *reasons: str) -> None:
    for reason in reasons:
        wait_for(f"the {reason} Event", lambda r=reason: events(kind, namespace, r, name), 120,
                 interval=POLL)  # fmt: skip


def canary_pod(kind: Kind, namespace: str, name: str, url: str) -> str:
    """The pod whose IP the canary's URL names."""
    ip = urlsplit(url).hostname
    return next(
        p["metadata"]["name"]
        for p in server_pods(kind, namespace, name)
        if p["status"].get("podIP") == ip
    )


def entry(tuning: dict, action: str, after: str = "") -> dict | None:
    """The first history entry of ``action`` later than the time ``after``."""
    for d in tuning.get("history") or []:
        if d.get("action") == action and d["time"] > after:
            return d
    return None


def trial(kind: Kind, namespace: str, name: str, tmp_path: Path, report) -> tuple[dict, dict]:
    """The planned lower tried on a canary: its history entry and status.tuning.experiment."""

    def tried():
        tuning = tuning_status(kind, namespace, name)
        e = tuning.get("experiment")
        return (entry(tuning, "canary"), e) if e and e.get("canary") else None

    try:
        canary, experiment = wait_for(f"a planned change of {name} on a canary", tried,
                                      TRIAL_TIMEOUT, interval=POLL)  # fmt: skip
    except AssertionError as e:
        report(f"{e}\n{dump(tuning_status(kind, namespace, name))}\n{load_logs(tmp_path)}")
    tuning = tuning_status(kind, namespace, name)
    assert experiment["kind"] == "lower", dump(tuning)
    assert (
        canary["reason"].startswith("testing on ") and "planned: max_num_seqs" in canary["reason"]
    )
    assert experiment["to"]["maxNumSeqs"] < START_MNS == experiment["from"]["maxNumSeqs"]
    # No verdict yet, and only the canary runs the change.
    assert tuning["maxNumSeqs"] == START_MNS, dump(tuning)
    print(f"{name}: {canary['reason']}")
    return canary, experiment


def verdict(kind: Kind, namespace: str, name: str, action: str, after: str, tmp_path: Path,
            report) -> dict:  # fmt: skip
    def judged():
        tuning = tuning_status(kind, namespace, name)
        return tuning if tuning.get("experiment") is None else None

    try:
        tuning = wait_for(f"the verdict on {name}'s canary", judged, VERDICT_TIMEOUT,
                          interval=POLL)  # fmt: skip
    except AssertionError as e:
        report(f"{e}\n{dump(tuning_status(kind, namespace, name))}\n{load_logs(tmp_path)}")
    ended = next(
        (d for d in tuning["history"] if d["time"] > after and d["action"] != "hold"), None
    )
    assert ended is not None and ended["action"] == action, dump(tuning)
    print(f"{name}: {ended['reason']}")
    return ended


def wait_pods_run(kind: Kind, namespace: str, name: str, want: dict[str, float], report) -> None:
    """Every pod of ``name`` reports the max_num_seqs ``want`` gives it (by pod name)."""
    try:
        wait_for(f"max_num_seqs {want} on {name}'s pods",
                 lambda: pod_max_num_seqs(kind, namespace, name) == want, 180,
                 interval=POLL)  # fmt: skip
    except AssertionError as e:
        report(f"{e}: {pod_max_num_seqs(kind, namespace, name)}")


def test_a_planned_lower_on_a_canary_is_kept_and_rolled_out(
    kind, namespace, services, tmp_path, report
):
    started = time.monotonic()
    with loaded(kind, namespace, KEEP, tmp_path, report) as urls:
        tried, experiment = trial(kind, namespace, KEEP, tmp_path, report)
        lowered = experiment["to"]["maxNumSeqs"]
        canary = canary_pod(kind, namespace, KEEP, experiment["canary"])
        control = next(p for p in urls if p != canary)
        wait_pods_run(kind, namespace, KEEP, {canary: lowered, control: START_MNS}, report)
        kept = verdict(kind, namespace, KEEP, "rollout", tried["time"], tmp_path, report)
    tuning = tuning_status(kind, namespace, KEEP)
    assert kept["kind"] == "lower" and kept["reason"].startswith("kept lower: "), dump(tuning)
    assert "no worse than 5%" in kept["reason"], dump(tuning)
    assert tuning["maxNumSeqs"] == kept["maxNumSeqs"] == lowered, dump(tuning)
    wait_pods_run(kind, namespace, KEEP, dict.fromkeys(urls, lowered), report)
    wait_events(kind, namespace, KEEP, "TuningTrial", "TuningKept")
    print(f"canary kept: {time.monotonic() - started:.0f} s")


def test_a_planned_lower_that_slows_its_canary_is_reverted(
    kind, namespace, services, tmp_path, report
):
    started = time.monotonic()
    hogs: list[subprocess.Popen] = []
    with loaded(kind, namespace, REVERT, tmp_path, report) as urls:
        try:
            tried, experiment = trial(kind, namespace, REVERT, tmp_path, report)
            canary = canary_pod(kind, namespace, REVERT, experiment["canary"])
            # Busy loops in the canary's own container (its cgroup): they end by themselves,
            # so none outlives the test if kubectl exec is cut.
            hog = f"import time\nend = time.time() + {HOG_SECONDS}\nwhile time.time() < end: pass"
            hogs = [kind_exec(kind, namespace, canary, hog) for _ in range(HOGS)]
            reverted = verdict(kind, namespace, REVERT, "revert", tried["time"], tmp_path, report)
        finally:
            for p in hogs:
                p.kill()
    tuning = tuning_status(kind, namespace, REVERT)
    assert reverted["kind"] == "lower", dump(tuning)
    assert reverted["reason"].startswith("reverted lower: step time at matched batch sizes"), dump(
        tuning
    )
    assert tuning["maxNumSeqs"] == reverted["maxNumSeqs"] == START_MNS, dump(tuning)
    wait_pods_run(kind, namespace, REVERT, dict.fromkeys(urls, START_MNS), report)
    wait_events(kind, namespace, REVERT, "TuningTrial", "TuningReverted")
    print(f"canary reverted: {time.monotonic() - started:.0f} s")


def kind_exec(kind: Kind, namespace: str, pod: str, code: str) -> subprocess.Popen:
    """``python3 -c code`` in the pod's server container, in the background."""
    return subprocess.Popen(
        ["kubectl", "exec", "-n", namespace, pod, "--", "python3", "-c", code],
        # The whole environment, as tests.support.kind.run gives it: without HOME, kubectl
        # writes its discovery cache into the working directory (the repository).
        env={**os.environ, **kind.env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
