"""Faults injected into real pods on kind, under steady load from a client inside the
cluster (issue 19, "Faults in kind"):

(a) ``kubectl delete pod`` of a serving replica loses no request (preStop, then the drain);
(b) a forced deletion (``--grace-period=0 --force``) fails only requests that replica was
    serving, and the Service recovers;
(d) a Ready replica whose /metrics stops answering the operator does not make the closed
    loop scale down;
(c) the operator pod killed in the middle of an fp8 roll: once it is back, the roll
    completes and the status converges.

The load is a pod of the server image (its Python, standard library only) sending
completions through the Service's ClusterIP at a fixed concurrency, one connection per
request, and printing one JSON line per request (worker, local port, start, end, status,
error); the test reads them back with ``kubectl logs``. Which replica served a request is
read from the node's connection tracking (kube-proxy's ``conntrack``): the ClusterIP's
DNAT entry of the request's source port names the pod it went to.

The fault in (d) drops the operator pod's packets to one server pod in the node's FORWARD
chain: the pod keeps serving and stays Ready (the kubelet probes it from the node), only
the scrape fails. Freezing the process instead (``kill -STOP``) makes the kubelet take it out
of the endpoints within 15 s and restart it within a minute (and PID 1 ignores a SIGSTOP
sent from inside its own container); what is left then is a replica that is not Ready,
which the loop rightly ignores.

Shares the session's cluster and images with test_kind_e2e.py (conftest.py); installs and
tears down its own operator release. Counts are printed (run with ``-s``) as
``FAULT (x): sent=... ok=... failed=...``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.kind import (
    OPERATOR_NAMESPACE,
    OPERATOR_SELECTOR,
    PLURAL,
    POLL,
    SERVER_IMAGE,
    SERVER_PORT,
    SERVICE,
    Kind,
    cpu_sample,
    is_ready,
    patch_spec,
    rollout_done,
    teardown,
    wait_ready,
)
from tests.support.wait import wait_for

pytestmark = pytest.mark.kind

SELECTOR = f"batchpilot.dev/service={SERVICE}"
REPLICAS = 2
MAX_NUM_SEQS = 4
# Requests in flight at all times. With 4 slots and a target queue of 1 per replica, 7 need
# 7/5 = 1.4 replicas (the loop keeps 2) while one replica's share alone (about 3.5) needs
# one: the demand at which losing one replica's metrics would look like room to scale down.
CONCURRENCY = 7
MAX_TOKENS = 8
CONNECT_TIMEOUT = 10.0
# A request takes 1-3 s on an idle 2-core machine, but 25-50 s when other work shares the
# cores (measured here, load average 10): generous, so that slowness is not a failure.
REQUEST_TIMEOUT = 300.0
# The drain waits this long for requests in flight (the default, 30 s, is shorter than one
# request on a loaded machine: the drain would end them with 503 and (a) would measure
# the machine, not the drain).
SHUTDOWN_TIMEOUT = 180
# How long a deleted pod keeps serving before its drain, so that the Service has dropped it
# before it exits. In the first whole-tier run the default 5 s was too short once during (c):
# one new connection's SYN went unanswered for 10 s (the connect timeout) mid-roll, as if
# DNAT-ed to an old pod already gone, on a node at load average 7-10.
PRE_STOP_SLEEP = 15
LOOP_INTERVAL = 15.0  # the chart's operator.loopInterval
SCALE_DOWN_WINDOW = 40  # (d)'s scaleDownStabilizationSeconds

LOAD_SCRIPT = r"""
import http.client, json, os, random, socket, sys, threading, time
host, port = os.environ["TARGET"], int(os.environ["TARGET_PORT"])
conc, max_tokens = int(os.environ["CONCURRENCY"]), int(os.environ["MAX_TOKENS"])
timeout = float(os.environ["REQUEST_TIMEOUT"])
connect_timeout = float(os.environ["CONNECT_TIMEOUT"])
lock = threading.Lock()
count = [0]
# Source ports taken in turn, not bind()'s random pick. A connection to a pod that died
# without closing it ((b)'s forced kill) leaves a conntrack entry that DNATs its 4-tuple to
# that pod for minutes after the socket is gone; a new connection from the same port then
# goes there and fails. One CI run failed 1 request of 1,275 in (d), two minutes after (b),
# with nothing else explaining it. In turn, no port comes back within a module's few
# thousand requests.
low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
next_port = [random.randint(low, high)]

def bound_socket():
    while True:
        with lock:
            port = next_port[0]
            next_port[0] = port + 1 if port < high else low
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", port))
            return s
        except OSError:  # in use by another socket: the next one
            s.close()

def out(rec):
    with lock:
        sys.stdout.write(json.dumps(rec, separators=(",", ":")) + "\n")
        sys.stdout.flush()

def model():
    while True:
        try:
            c = http.client.HTTPConnection(host, port, timeout=10)
            c.request("GET", "/v1/models")
            r = c.getresponse()
            body = r.read()
            c.close()
            if r.status == 200:
                return json.loads(body)["data"][0]["id"]
        except Exception:
            pass
        time.sleep(1)

name = model()
out({"event": "start", "model": name, "t": time.time()})

def worker(w):
    while True:
        with lock:
            i = count[0]
            count[0] += 1
        body = json.dumps({"model": name, "prompt": f"Request {i}: count from one to ten.",
                           "max_tokens": max_tokens, "temperature": 0})
        rec = {"i": i, "w": w, "t0": time.time()}
        c = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            # Bound before connecting: a request that never connects has a port too.
            s = bound_socket()
            s.settimeout(connect_timeout)
            rec["port"] = s.getsockname()[1]
            c.sock = s
            s.connect((host, port))
            s.settimeout(timeout)
            c.request("POST", "/v1/completions", body,
                      {"Content-Type": "application/json", "Connection": "close"})
            r = c.getresponse()
            data = r.read()
            rec["status"] = r.status
            rec["ok"] = r.status == 200 and bool(json.loads(data)["choices"][0]["text"])
            if not rec["ok"]:
                rec["err"] = data[:200].decode("utf-8", "replace")
        except Exception as e:
            rec["ok"] = False
            rec["err"] = f"{type(e).__name__}: {e}"[:200]
        finally:
            c.close()
        rec["t1"] = time.time()
        out(rec)
        if not rec["ok"]:
            time.sleep(0.2)

for w in range(conc):
    threading.Thread(target=worker, args=(w,), daemon=True).start()
while True:
    time.sleep(3600)
"""

CONNTRACK = re.compile(
    r"src=(?P<src>\S+) dst=\S+ sport=(?P<sport>\d+) dport=(?P<dport>\d+) "
    r"(?:\[UNREPLIED\] )?src=(?P<backend>\S+) dst=\S+ sport=\d+"
)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def service(kind: Kind, namespace: str, operator, report) -> Iterator[dict]:
    """The CPU sample with two replicas of 4 slots each, autoscaling off to begin with, and a
    drain long enough for a request on a loaded machine."""
    sample = cpu_sample(namespace)
    sample["spec"]["replicas"] = REPLICAS
    sample["spec"]["engine"]["maxNumSeqs"] = MAX_NUM_SEQS
    sample["spec"]["server"] = {
        "shutdownTimeoutSeconds": SHUTDOWN_TIMEOUT,
        "preStopSleepSeconds": PRE_STOP_SLEEP,
    }
    kind.apply(sample)
    yield wait_ready(kind, namespace, report, REPLICAS, exact=True)
    teardown(kind, namespace)


@dataclass
class Load:
    kind: Kind
    namespace: str
    pod: str
    ip: str

    def records(self) -> list[dict]:
        out = self.kind.kubectl("logs", "-n", self.namespace, self.pod, timeout=60).stdout
        return [
            r
            for line in out.splitlines()
            if line.startswith("{") and "t0" in (r := json.loads(line))
        ]

    def settled(self, cut: float) -> list[dict]:
        """Every request started before ``cut``, once all have ended: each worker sends
        one request at a time, so a worker's record that started after ``cut`` means all
        of its earlier ones are in."""

        def done():
            recs = self.records()
            later = {r["w"] for r in recs if r["t0"] >= cut}
            return len(later) == CONCURRENCY and recs

        recs = wait_for(f"every request started before {cut:.0f} to end", done,
                        REQUEST_TIMEOUT + 120, interval=3)  # fmt: skip
        return [r for r in recs if r["t0"] < cut]

    def wait_recovered(self, since: float, count: int, timeout: float = 300) -> None:
        """``count`` requests succeeded that started after the last failure since ``since``
        (a request the Service sent to the killed pod can fail seconds after the kill; the
        recovery is counted from it, not from the kill: one CI run had 17 after it)."""

        def recovered() -> bool:
            recs = [r for r in self.records() if r["t0"] >= since]
            last = max((r["t0"] for r in recs if not r["ok"]), default=since)
            return sum(r["ok"] for r in recs if r["t0"] > last) >= count

        wait_for(
            f"{count} requests to succeed after the last failure", recovered, timeout, interval=POLL
        )

    def wait_ok(self, after: float, count: int, timeout: float = 300) -> None:
        wait_for(
            f"{count} requests started after {after:.0f} to succeed",
            lambda: sum(r["ok"] for r in self.records() if r["t0"] >= after) >= count,
            timeout,
            interval=POLL,
        )


@pytest.fixture(scope="module")
def load(kind: Kind, namespace: str, service, report) -> Iterator[Load]:
    cluster_ip = kind.get("service", SERVICE, "-n", namespace)["spec"]["clusterIP"]
    env = {"TARGET": cluster_ip, "TARGET_PORT": str(SERVER_PORT),
           "CONCURRENCY": str(CONCURRENCY), "MAX_TOKENS": str(MAX_TOKENS),
           "REQUEST_TIMEOUT": str(REQUEST_TIMEOUT), "CONNECT_TIMEOUT": str(CONNECT_TIMEOUT)}  # fmt: skip
    kind.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "load", "namespace": namespace, "labels": {"app": "load"}},
            "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "load",
                        "image": SERVER_IMAGE,
                        "imagePullPolicy": "Never",
                        "command": ["python3", "-u", "-c", LOAD_SCRIPT],
                        "env": [{"name": k, "value": v} for k, v in env.items()],
                        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                    }
                ],
            },
        }
    )
    try:
        pod = wait_for(
            "the load pod to run",
            lambda: (
                (p := kind.get("pod", "load", "-n", namespace))["status"].get("podIP")
                and p["status"].get("phase") == "Running"
                and p
            ),
            180,
            interval=POLL,
        )
        handle = Load(kind, namespace, "load", pod["status"]["podIP"])
        handle.wait_ok(0, CONCURRENCY, timeout=300)
    except AssertionError as e:
        report(str(e))
    yield handle
    kind.kubectl("delete", "pod", "load", "-n", namespace, "--wait=false")


# --------------------------------------------------------------------------- helpers


def server_pods(kind: Kind, namespace: str) -> list[dict]:
    pods = kind.get("pods", "-n", namespace, "-l", SELECTOR)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def two_ready(kind: Kind, namespace: str) -> list[dict]:
    """Exactly REPLICAS server pods, all Ready, none terminating, Deployment settled."""
    pods = kind.get("pods", "-n", namespace, "-l", SELECTOR)["items"]
    dep = kind.get("deployment", SERVICE, "-n", namespace)
    st = dep.get("status", {})
    if (
        len(pods) == REPLICAS
        and all(is_ready(p) and not p["metadata"].get("deletionTimestamp") for p in pods)
        and dep["spec"]["replicas"] == REPLICAS
        and st.get("readyReplicas") == REPLICAS
        and st.get("updatedReplicas") == REPLICAS
    ):
        return pods
    return []


def counts(records: list[dict]) -> tuple[int, int, int]:
    ok = sum(1 for r in records if r["ok"])
    return len(records), ok, len(records) - ok


def describe(failed: list[dict], origin: float, backends: dict[int, set[str]], victim_ip: str
             ) -> str:  # fmt: skip
    """The failed requests, each with its error, when it started (s after ``origin``), how
    long it took and the pod(s) conntrack saw it go to."""
    lines = [
        f"#{r['i']} worker {r['w']} at {r['t0'] - origin:+.1f}s for {r['t1'] - r['t0']:.1f}s, "
        f"status {r.get('status')}: {r.get('err')!r}; backend "
        f"{sorted(backends.get(r.get('port', -1), set())) or 'none seen'}"
        for r in failed[:5]
    ]
    return f"{len(failed)} failed (victim {victim_ip}):\n" + "\n".join(lines)


def say(label: str, records: list[dict], extra: str = "") -> None:
    sent, ok, failed = counts(records)
    print(f"FAULT {label}: sent={sent} ok={ok} failed={failed}{extra}", flush=True)


def kube_proxy(kind: Kind) -> str:
    pods = kind.get("pods", "-n", "kube-system", "-l", "k8s-app=kube-proxy")["items"]
    assert pods, "no kube-proxy pod"
    return pods[0]["metadata"]["name"]


def node_exec(kind: Kind, proxy: str, *cmd: str):
    """A command in the node's network namespace (kube-proxy runs in it, privileged, with
    iptables and conntrack)."""
    return kind.kubectl("exec", "-n", "kube-system", proxy, "--", *cmd, timeout=60)


class ConntrackWatch:
    """Polls the node's conntrack table for the load pod's connections to the Service port
    while a fault runs; ``stop`` maps each source port to the pod IPs it was DNAT-ed to
    (closed connections stay in the table for seconds to minutes, so polling once a second
    misses none)."""

    def __init__(self, kind: Kind, proxy: str, client_ip: str, workdir):
        script = (
            f"while :; do conntrack -L -p tcp -s {client_ip} --dport {SERVER_PORT} "
            "2>/dev/null; echo ---; sleep 1; done"
        )
        self.path = workdir / f"conntrack-{time.time():.0f}.txt"
        self.file = self.path.open("w")
        self.proc = subprocess.Popen(
            ["kubectl", "exec", "-n", "kube-system", proxy, "--", "sh", "-c", script],
            env={**os.environ, **kind.env},
            stdout=self.file,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.client_ip = client_ip
        wait_for("conntrack's first polls", lambda: self.path.read_text().count("---") >= 2,
                 60, interval=0.5)  # fmt: skip

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.file.close()

    def stop(self) -> dict[int, set[str]]:
        # Two more whole polls before the stream is cut: a connection refused by a dying
        # pod stays in the table only 10 s (CLOSE), and on a loaded node kubectl's stream
        # lags the polls by seconds, so terminating at once lost the entry of a request that
        # failed shortly before (one CI run: the only failure, refused, with no backend).
        polls = self.path.read_text().count("---")
        wait_for("two conntrack polls after the fault's window",
                 lambda: self.path.read_text().count("---") >= polls + 2, 60, interval=0.5)  # fmt: skip
        self.close()
        out = self.path.read_text()
        backends: dict[int, set[str]] = {}
        for m in CONNTRACK.finditer(out):
            if m["src"] == self.client_ip and int(m["dport"]) == SERVER_PORT:
                backends.setdefault(int(m["sport"]), set()).add(m["backend"])
        assert backends, f"conntrack showed none of the load's connections:\n{out[-2000:]}"
        return backends


# --------------------------------------------------------------------------- (a)


def test_a_graceful_delete_of_a_serving_replica_loses_no_request(kind, namespace, load, report):
    try:
        wait_for("two Ready replicas", lambda: two_ready(kind, namespace), 600, interval=3)
        begin = time.time()
        load.wait_ok(begin, 2 * CONCURRENCY)
        victim = server_pods(kind, namespace)[0]["metadata"]["name"]
        deleted = time.time()
        # Waits until the pod is gone: preStop sleep, then the drain of what it serves.
        kind.kubectl("delete", "pod", victim, "-n", namespace, "--wait=true", timeout=300)
        gone = time.time()
        wait_for("a replacement replica Ready", lambda: two_ready(kind, namespace), 600, interval=3)
        load.wait_ok(time.time(), 2 * CONCURRENCY)
    except AssertionError as e:
        report(str(e))
    records = load.settled(time.time())
    window = [r for r in records if r["t0"] >= begin]
    during = [r for r in window if r["t1"] >= deleted and r["t0"] <= gone]
    say("(a) graceful delete", window,
        f" (in flight while {victim} terminated, {gone - deleted:.0f}s: {len(during)})")  # fmt: skip
    failed = [r for r in window if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(window)} requests failed: {failed[:5]}"
    assert len(during) >= CONCURRENCY, "the load did not run through the termination"


# --------------------------------------------------------------------------- (b)


@dataclass
class ForcedDelete:
    """One forced delete: the requests from just before it until recovery, where each went,
    and when the victim was killed."""

    window: list[dict]
    backends: dict[int, set[str]]
    victim_ip: str
    survivor_ip: str
    killed: float

    def on(self, ip: str) -> list[dict]:
        return [r for r in self.window if ip in self.backends.get(r.get("port", -1), set())]

    def refused_unrouted(self, r: dict) -> bool:
        return (
            r["t0"] >= self.killed
            and r.get("err", "").startswith("ConnectionRefusedError")
            and r.get("port", -1) not in self.backends
        )

    @property
    def in_flight(self) -> list[dict]:
        return [r for r in self.on(self.victim_ip) if r["t0"] <= self.killed <= r["t1"]]


def force_delete_one(kind, namespace, load, report, tmp_path, proxy) -> ForcedDelete:
    watch = None
    try:
        pods = wait_for("two Ready replicas", lambda: two_ready(kind, namespace), 600, interval=3)
        begin = time.time()
        load.wait_ok(begin, 2 * CONCURRENCY)
        victim, survivor = pods[0], pods[1]
        watch = ConntrackWatch(kind, proxy, load.ip, tmp_path)
        killed = time.time()
        kind.kubectl("delete", "pod", victim["metadata"]["name"], "-n", namespace,
                     "--grace-period=0", "--force", "--wait=false")  # fmt: skip
        # Recovered: requests started after the last failure succeed again.
        load.wait_recovered(killed, 3 * CONCURRENCY, timeout=300)
        recovered = time.time()
        records = load.settled(recovered)
        backends = watch.stop()
        wait_for("a replacement replica Ready", lambda: two_ready(kind, namespace), 600, interval=3)
    except AssertionError as e:
        if watch is not None:
            watch.close()
        report(str(e))
    window = [r for r in records if r["t0"] >= begin]
    return ForcedDelete(window, backends, victim["status"]["podIP"],
                        survivor["status"]["podIP"], killed)  # fmt: skip


# Requests of MAX_TOKENS take a fraction of a second on a quiet machine, so at the instant
# of a kill the victim serves none often enough (once in a CI run: 40 requests on it in
# the window, none in flight at the kill) to try again rather than test nothing.
FORCED_DELETE_ATTEMPTS = 3


def test_b_forced_delete_fails_only_that_replicas_requests_and_the_service_recovers(
    kind, namespace, load, report, tmp_path
):
    proxy = kube_proxy(kind)
    for attempt in range(1, FORCED_DELETE_ATTEMPTS + 1):
        trial = force_delete_one(kind, namespace, load, report, tmp_path, proxy)
        failed = [r for r in trial.window if not r["ok"]]
        say(f"(b) forced delete, attempt {attempt}", trial.window,
            f" (on the killed replica: {len(trial.on(trial.victim_ip))} in all, "
            f"{len(trial.in_flight)} in flight at the kill; failed {len(failed)}, of which "
            f"{sum(map(trial.refused_unrouted, failed))} refused unrouted)")  # fmt: skip
        # Each failure was a connection that the Service had sent to the killed pod, or one
        # refused after the kill that conntrack never showed going to any pod (the survivor
        # listens throughout, so no pod it reached was serving it: one CI run had one).
        unattributed = [
            r for r in failed
            if trial.victim_ip not in trial.backends.get(r.get("port", -1), set())
            and not trial.refused_unrouted(r)
        ]  # fmt: skip
        assert not unattributed, (
            f"failed requests that the killed pod {trial.victim_ip} was not serving: "
            f"{unattributed[:5]} (their backends: "
            f"{[trial.backends.get(r.get('port', -1)) for r in unattributed[:5]]})"
        )
        on_survivor = trial.on(trial.survivor_ip)
        assert on_survivor and all(r["ok"] for r in on_survivor), "a request on the survivor failed"
        # And none after the Service dropped the pod: everything started once requests
        # succeeded again succeeded.
        last_failure = max((r["t0"] for r in failed), default=trial.killed)
        after = [r for r in trial.window if r["t0"] > last_failure]
        assert len(after) >= 3 * CONCURRENCY and all(r["ok"] for r in after)
        assert last_failure - trial.killed < 30, (
            f"requests kept failing {last_failure - trial.killed:.0f}s on"
        )
        if trial.in_flight:
            return
    pytest.fail(
        f"the killed replica was serving nothing at the kill in {FORCED_DELETE_ATTEMPTS} "
        "attempts: the fault tested nothing"
    )


# --------------------------------------------------------------------------- (d)


def autoscaling_status(kind: Kind, namespace: str) -> dict:
    return kind.get(PLURAL, SERVICE, "-n", namespace).get("status", {}).get("autoscaling") or {}


def forget_capacity(kind: Kind, namespace: str) -> float:
    """Remove the loop's capacity figure from status; returns when.

    (d) asks the scrape guard, so the slots alone must make the loop want fewer replicas
    once one goes unscraped. A figure measured earlier in the module (during (b)'s forced
    kill, one replica taking the whole load on two busy cores: 9.8 tokens/s in one CI run)
    makes the throughput floor keep 2 instead, and the guard is never asked. With 7 requests
    for 8 slots little queues in (d), but a replica that briefly does measures a new figure,
    so (d) forgets it again whenever it appears."""
    patch = {"status": {"autoscaling": {"capacityTokensPerSecond": None}}}
    kind.kubectl("patch", PLURAL, SERVICE, "-n", namespace, "--subresource=status",
                 "--type=merge", "-p", json.dumps(patch))  # fmt: skip
    return time.time()


def test_d_a_replica_whose_metrics_stop_answering_does_not_scale_the_service_down(
    kind, namespace, load, report, tmp_path
):
    proxy = kube_proxy(kind)
    try:
        pods = wait_for("two Ready replicas", lambda: two_ready(kind, namespace), 600, interval=3)
        # Builtin autoscaling starts from minReplicas until the loop's first decision is in
        # status (turned on with minReplicas 1 it would drop a replica at once), and this
        # load's demand seen by the loop wanders around 1-1.4 replicas' worth: on at 2..2
        # until the fault, so that only the fault can make the loop want fewer.
        autoscaling = {
            "enabled": True, "mode": "builtin", "minReplicas": REPLICAS,
            "maxReplicas": REPLICAS, "targetQueueLength": 1, "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW,
        }  # fmt: skip
        patch_spec(kind, namespace, {"autoscaling": autoscaling})
        cleared = forget_capacity(kind, namespace)

        def fresh_turn() -> bool:
            nonlocal cleared
            a = autoscaling_status(kind, namespace)
            if a.get("time", "") <= iso(cleared):
                return False
            if a.get("capacityTokensPerSecond"):  # written back by a turn that read it before
                cleared = forget_capacity(kind, namespace)
                return False
            scraped = kind.get(PLURAL, SERVICE, "-n", namespace)["status"].get("metrics", {})
            return (
                a.get("desiredReplicas") == REPLICAS and scraped.get("replicasScraped") == REPLICAS
            )

        wait_for("a loop turn that scraped both replicas, keeps 2, knows no capacity",
                 fresh_turn, 300, interval=POLL)  # fmt: skip
    except AssertionError as e:
        report(str(e))
    victim = pods[0]
    victim_ip, victim_name = victim["status"]["podIP"], victim["metadata"]["name"]
    operator_ip = next(
        p["status"]["podIP"]
        for p in kind.get("pods", "-n", OPERATOR_NAMESPACE, "-l", OPERATOR_SELECTOR)["items"]
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    )
    rule = ["FORWARD", "-s", operator_ip, "-d", victim_ip, "-p", "tcp", "-j", "DROP"]
    replicas_seen: list[tuple[float, int, int]] = []
    held: dict = {}
    # Where each request went, so that a failure names its backend (one CI run failed one
    # request of 1,275 here, and the record alone could not say where or why).
    conntrack = ConntrackWatch(kind, proxy, load.ip, tmp_path)
    fault = time.time()
    patch_spec(kind, namespace, {"autoscaling": {**autoscaling, "minReplicas": 1}})
    node_exec(kind, proxy, "iptables", "-w", "-I", *rule)
    turns: set[str] = set()
    reasons: list[str] = []
    try:

        def watch() -> bool:
            nonlocal held
            dep = kind.get("deployment", SERVICE, "-n", namespace)
            replicas_seen.append((time.time() - fault, dep["spec"]["replicas"],
                                  dep["status"].get("readyReplicas", 0)))  # fmt: skip
            a = autoscaling_status(kind, namespace)
            if a.get("time", "") not in turns:
                reasons.append(f"{a.get('time')}: {a.get('reason')}")
            turns.add(a.get("time", ""))
            # A capacity figure measured during the fault (the answering replica briefly
            # queued: one CI run) makes the throughput floor keep 2, and the guard is not
            # asked while it stands: forgotten again, as before the fault.
            if a.get("capacityTokensPerSecond"):
                forget_capacity(kind, namespace)
            if a.get("scaleDownHeld") and not held:
                held = {**a, "seen": time.time()}
            # Held for longer than the scale-down window and one more turn: by then the
            # unguarded loop had scaled down (in the unit test and in the first kind run).
            return (
                bool(held)
                and time.time() - held["seen"] > SCALE_DOWN_WINDOW + LOOP_INTERVAL + 5
                and a.get("scaleDownHeld")
            )

        # The faulted replica's samples leave the 60 s window, then the recommendation
        # falls to one replica's worth.
        wait_for("the loop to hold a scale-down for the unscraped replica", watch, 480, interval=2)
        victim_now = kind.get("pod", victim_name, "-n", namespace)
    except AssertionError as e:
        node_exec(kind, proxy, "iptables", "-w", "-D", *rule)
        conntrack.close()
        report(f"{e}; replicas (s after fault, spec, ready): {replicas_seen[-10:]}; "
               f"the loop's last reasons: {reasons[-6:]}")  # fmt: skip
    node_exec(kind, proxy, "iptables", "-w", "-D", *rule)
    healed = time.time()
    try:
        wait_for(
            "the hold to lift once the replica answers again",
            lambda: (
                (a := autoscaling_status(kind, namespace)).get("time", "") > iso(healed + 1)
                and not a.get("scaleDownHeld")
            ),
            120,
            interval=POLL,
        )
    except AssertionError as e:
        report(str(e))
    # Autoscaling off again: spec.replicas (2) for what follows, whatever the loop does next.
    patch_spec(kind, namespace, {"autoscaling": {"enabled": False}})
    records = [r for r in load.settled(time.time()) if r["t0"] >= fault]
    backends = conntrack.stop()
    lowest = min(spec for _, spec, _ in replicas_seen)
    say("(d) unanswered /metrics", records,
        f" (replicas {lowest}-{max(s for _, s, _ in replicas_seen)} over "
        f"{len(replicas_seen)} looks and {len(turns)} loop turns in {healed - fault:.0f}s; held "
        f"from {held['seen'] - fault:.0f}s on, the answering replica alone recommending "
        f"{held['scaleDownHeld']['recommendation']})")  # fmt: skip
    assert lowest == REPLICAS, f"the loop scaled down: {replicas_seen}"
    assert held["scaleDownHeld"]["recommendation"] < REPLICAS, held
    assert held["desiredReplicas"] == REPLICAS
    assert any(victim_ip in url for url in held["scaleDownHeld"]["unscraped"]), held
    assert "did not answer their scrape" in held["reason"], held
    # The fault was the scrape only: the replica stayed Ready and served throughout.
    assert is_ready(victim_now) and not victim_now["metadata"].get("deletionTimestamp")
    failed = [r for r in records if not r["ok"]]
    assert not failed, describe(failed, fault, backends, victim_ip)
    events = kind.get("events", "-n", namespace, "--field-selector", "reason=ScaleDownHeld")
    assert events["items"], "no ScaleDownHeld Event"


def iso(t: float) -> str:
    """An RFC 3339 time as the loop writes it, for string comparison with its stamps."""
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------- (c)


def test_c_the_operator_killed_mid_fp8_roll_comes_back_and_the_roll_converges(
    kind, namespace, load, report, tmp_path
):
    watch = None
    try:
        before = wait_for("two Ready replicas", lambda: two_ready(kind, namespace), 600, interval=3)
        old_pods = {p["status"]["podIP"]: p["metadata"]["name"] for p in before}
        begin = time.time()
        load.wait_ok(begin, CONCURRENCY)
        # Which pod each request reached, to say where a failure happened.
        watch = ConntrackWatch(kind, kube_proxy(kind), load.ip, tmp_path)
        generation = kind.get("deployment", SERVICE, "-n", namespace)["metadata"]["generation"]
        (old,) = [
            p["metadata"]["name"]
            for p in kind.get("pods", "-n", OPERATOR_NAMESPACE, "-l", OPERATOR_SELECTOR)["items"]
            if not p["metadata"].get("deletionTimestamp")
        ]
        patch_spec(kind, namespace,
                   {"engine": {"kvCacheDtype": "fp8"}, "autoscaling": {"enabled": False}})  # fmt: skip
        # The operator has put fp8 into the pod template: the roll has begun.
        wait_for(
            "the operator to start the fp8 roll",
            lambda: (
                kind.get("deployment", SERVICE, "-n", namespace)["metadata"]["generation"]
                > generation
            ),
            120,
            interval=1,
        )
        dep = kind.get("deployment", SERVICE, "-n", namespace)
        killed = time.time()
        kind.kubectl("delete", "pod", old, "-n", OPERATOR_NAMESPACE, "--grace-period=0",
                     "--force", "--wait=false")  # fmt: skip
        mid_roll = dep.get("status", {})
        back = wait_for(
            "a new operator pod Ready",
            lambda: [
                p["metadata"]["name"]
                for p in kind.get("pods", "-n", OPERATOR_NAMESPACE, "-l", OPERATOR_SELECTOR)[
                    "items"
                ]
                if p["metadata"]["name"] != old and is_ready(p)
            ],
            300,
            interval=POLL,
        )
        wait_for("the fp8 roll to complete", lambda: rollout_done(kind, namespace, generation),
                 900, interval=3)  # fmt: skip

        def converged():
            isvc = kind.get(PLURAL, SERVICE, "-n", namespace)
            st = isvc.get("status", {})
            return (
                (st.get("engine") or {}).get("kvCacheDtype") == "fp8"
                and st.get("observedGeneration") == isvc["metadata"]["generation"]
                and is_ready(isvc)
                and st.get("readyReplicas") == REPLICAS
                and st.get("updatedReplicas") == REPLICAS
                and isvc
            )

        isvc = wait_for("the status to converge on fp8", converged, 300, interval=3)
        done = time.time()
        records = [r for r in load.settled(done) if r["t0"] >= begin]
        backends = watch.stop()
    except AssertionError as e:
        if watch is not None:
            watch.close()
        report(str(e))
    say("(c) operator killed mid fp8 roll", records,
        f" (killed {killed - begin:.0f}s in with updatedReplicas="
        f"{mid_roll.get('updatedReplicas', 0)}/{REPLICAS}; back as {back[0]}; converged "
        f"{done - killed:.0f}s after the kill)")  # fmt: skip
    assert (
        mid_roll.get("updatedReplicas", 0) < REPLICAS
        or mid_roll.get("observedGeneration", 0) < dep["metadata"]["generation"]
    ), f"the roll was over before the kill: {mid_roll}"
    pods = server_pods(kind, namespace)
    args = [" ".join(p["spec"]["containers"][0].get("args", [])) for p in pods]
    assert len(pods) == REPLICAS and all("fp8" in a for a in args), args
    conditions = {c["type"]: c["status"] for c in isvc["status"]["conditions"]}
    assert conditions.get("Degraded") != "True", conditions
    failed = [r for r in records if not r["ok"]]
    where = [
        {ip: old_pods.get(ip, "a new pod") for ip in backends.get(r.get("port", -1), ())}
        for r in failed
    ]
    assert not failed, (
        f"{len(failed)} of {len(records)} requests failed: {failed[:5]}; they reached {where[:5]} "
        f"(killed at {killed:.1f}, converged at {done:.1f})"
    )
