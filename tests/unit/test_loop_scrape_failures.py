"""A Ready replica whose /metrics stops answering is not a replica without demand: the
closed loop holds any scale-down while a scrape fails, says so in status.autoscaling and
with one ScaleDownHeld Event, and scales as usual again once every replica answers.

Issue 19's fault (d); kind-tests/test_kind_faults.py injects the same fault on real pods."""

from __future__ import annotations

import asyncio

from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.scrape import Scrape
from batchpilot.operator.loop.tuner_state import EngineSettings
from batchpilot.operator.loop.turn import ClosedLoop
from benchmarks.loopsim import EngineModel, ReplicaConfig, ReplicaSim, Request

SPEC = parse_spec(
    {
        "engine": {"maxNumSeqs": 4},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4,
                        "targetQueueLength": 2, "scaleUpStabilizationSeconds": 0,
                        "scaleDownStabilizationSeconds": 30},
    }
)  # fmt: skip
TICK = 15.0


class ClosedLoadReplicas:
    """Simulated replicas, each kept at ``per_replica`` requests in the system (a closed
    loop of clients spread evenly over them, as a Service spreads connections), behind
    the metrics-source interface; a URL in ``silent`` answers no scrape but keeps serving."""

    def __init__(self, count: int, per_replica: int):
        self.engines = {
            f"http://r{i}": ReplicaSim(f"http://r{i}", ReplicaConfig(max_num_seqs=4),
                                       EngineModel(), 0.0)
            for i in range(count)
        }  # fmt: skip
        self.per_replica = per_replica
        self.silent: set[str] = set()

    def advance(self, t: float) -> None:
        for engine in self.engines.values():
            while engine.time < t:  # clients send the next request as soon as one ends
                in_system = len(engine.running) + len(engine.waiting) + len(engine.swapped)
                for _ in range(self.per_replica - in_system):
                    engine.submit(Request(engine.time, 64, 256))
                engine.advance_to(min(t, engine.time + 0.2))

    async def scrape(self, namespace: str, name: str) -> list[Scrape]:
        return [
            Scrape(url, error="TimeoutError") if url in self.silent
            else Scrape(url, text=e.metrics_text())
            for url, e in self.engines.items()
        ]  # fmt: skip


def turns(loop, replicas, status, start: float, count: int):
    """``count`` loop turns from ``start``; the Deployment keeps len(engines) replicas (the
    test asserts on what the loop asks for, which is what the reconcile would apply)."""
    outcomes = []
    for i in range(count):
        now = start + i * TICK
        loop.clock = lambda now=now: now
        replicas.advance(now)
        outcome = asyncio.run(
            loop.run_once("ns", "chat", SPEC, status, len(replicas.engines), EngineSettings(4),
                          "token")
        )  # fmt: skip
        status.update(outcome.status_patch)
        outcomes.append(outcome)
    return outcomes


def test_a_replica_that_stops_answering_its_scrape_does_not_scale_the_service_down():
    # Two replicas, each with 4 requests in the system (its 4 slots busy, no queue):
    # 8 requests against 4 slots + a target queue of 2 per replica need 1.33 replicas, so
    # the loop stays at 2; one replica's share alone (4 of 6) would need one.
    replicas = ClosedLoadReplicas(2, per_replica=4)
    loop = ClosedLoop(replicas, admin=None)
    status: dict = {}
    before = turns(loop, replicas, status, 0.0, 8)
    assert all(o.desired_replicas == 2 for o in before), [o.status_patch for o in before]

    # r1 keeps serving its share but its /metrics stops answering for longer than the
    # observer's window (60 s): its samples age out and r0's alone look like half the load.
    replicas.silent.add("http://r1")
    during = turns(loop, replicas, status, 8 * TICK, 10)
    assert [o.desired_replicas for o in during] == [2] * 10, [
        o.status_patch["autoscaling"]["reason"] for o in during
    ]
    assert all(set(o.scrape_failures) == {"http://r1"} for o in during)
    held = [o for o in during if o.status_patch["autoscaling"]["scaleDownHeld"]]
    assert held, "the hold is never reported: the test did not reach a would-be scale-down"
    first = held[0].status_patch["autoscaling"]
    assert held == during[during.index(held[0]) :], "the hold flapped on and off"
    assert first["scaleDownHeld"] == {
        "replicas": 2,
        "recommendation": 1,
        "unscraped": ["http://r1"],
    }
    assert first["desiredReplicas"] == 2
    assert "did not answer their scrape" in first["reason"] and "http://r1" in first["reason"]
    events = [e for o in during for e in o.events]
    assert [reason for reason, _ in events] == ["ScaleDownHeld"], events  # once, not per turn
    assert not any(reason == "ScaledDown" for o in during for reason, _ in o.events)

    # r1 answers again: the hold lifts (status says so: None deletes the key from the
    # merge-patched status) and, the load unchanged, 2 it is.
    replicas.silent.clear()
    after = turns(loop, replicas, status, 18 * TICK, 6)
    assert all(o.desired_replicas == 2 for o in after)
    assert after[0].status_patch["autoscaling"]["scaleDownHeld"] is None


def test_after_a_hold_a_scale_down_needs_a_whole_window_of_fresh_evidence():
    """The recommendations made while a replica was unscraped saw part of the demand: they
    are not kept, so the first low reading after the fault does not scale down at once."""
    replicas = ClosedLoadReplicas(2, per_replica=4)
    loop = ClosedLoop(replicas, admin=None)
    status: dict = {}
    turns(loop, replicas, status, 0.0, 8)
    replicas.silent.add("http://r1")
    during = turns(loop, replicas, status, 8 * TICK, 10)
    assert during[-1].status_patch["autoscaling"]["scaleDownHeld"]
    kept = status["autoscaling"]["recommendations"]
    assert [r["replicas"] for r in kept] == [2], kept
    # Healed, and the load really drops to one replica's worth.
    replicas.silent.clear()
    replicas.per_replica = 1
    after = turns(loop, replicas, status, 18 * TICK, 6)
    desired = [o.desired_replicas for o in after]
    down = desired.index(1)  # it does scale down, on fresh evidence
    # A scale-down window after the last held turn (17 * TICK), not at the first low
    # reading, as the low readings kept from the fault would have allowed.
    since_hold = (18 + down) * TICK - 17 * TICK
    assert down >= 1 and since_hold >= SPEC.autoscaling.scale_down_stabilization_seconds, desired


def test_a_scale_up_is_not_held_by_a_failing_scrape():
    replicas = ClosedLoadReplicas(2, per_replica=20)  # far over two replicas' worth
    replicas.silent.add("http://r1")
    loop = ClosedLoop(replicas, admin=None)
    status: dict = {}
    outcomes = turns(loop, replicas, status, 0.0, 3)
    assert max(o.desired_replicas for o in outcomes) > 2, status["autoscaling"]
    assert status["autoscaling"]["scaleDownHeld"] is None


def test_a_scale_down_with_every_replica_answering_is_not_held():
    replicas = ClosedLoadReplicas(2, per_replica=1)  # one replica's worth, over two
    loop = ClosedLoop(replicas, admin=None)
    status: dict = {}
    outcomes = turns(loop, replicas, status, 0.0, 6)
    assert outcomes[-1].desired_replicas == 1, status["autoscaling"]
    assert "ScaledDown" in [r for o in outcomes for r, _ in o.events]
    assert status["autoscaling"]["scaleDownHeld"] is None
