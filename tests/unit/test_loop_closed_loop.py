"""loop.ClosedLoop.run_once: the status contract with the kopf side, statelessness across
operator restarts, live application to every replica, and repair of stray replicas."""

from __future__ import annotations

import asyncio

from batchpilot import names
from batchpilot.operator.crd import parse_spec
from batchpilot.operator.loop import ClosedLoop
from batchpilot.operator.observe import Scrape
from batchpilot.operator.resources import LoopState
from batchpilot.operator.sim import EngineModel, ReplicaConfig, ReplicaSim, Request
from batchpilot.operator.tune import EngineSettings

SPEC = parse_spec(
    {
        "engine": {"maxNumSeqs": 4},
        "autoscaling": {"enabled": True, "maxReplicas": 4},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 2, "max": 64}, "cooldownSeconds": 120,
                   "targetInterTokenLatencySeconds": 1.0},
    }
)  # fmt: skip


class Replicas:
    """Simulated replicas behind the two interfaces the loop talks to: a metrics source
    and the admin client's set_max_num_seqs (which records what it was asked)."""

    def __init__(self, count: int, max_num_seqs: int = 4):
        config = ReplicaConfig(max_num_seqs=max_num_seqs)
        self.engines = {
            f"http://r{i}": ReplicaSim(f"http://r{i}", config, EngineModel(), 0.0)
            for i in range(count)
        }
        self.down: set[str] = set()
        self.patches: list[tuple[str, int]] = []

    def load(self, requests: int, now: float) -> None:
        for engine in self.engines.values():
            for _ in range(requests):
                engine.submit(Request(now, 64, 512))

    def advance(self, t: float) -> None:
        for engine in self.engines.values():
            engine.advance_to(t)

    async def scrape(self, namespace: str, name: str) -> list[Scrape]:
        return [
            Scrape(url, error="refused") if url in self.down else Scrape(url, text=e.metrics_text())
            for url, e in self.engines.items()
        ]

    async def set_max_num_seqs(self, urls, token: str, value: int) -> dict[str, str | None]:
        assert token == "secret"
        for url in urls:
            self.patches.append((url, value))
            self.engines[url].max_num_seqs = value
        return dict.fromkeys(urls)


def run(loop: ClosedLoop, replicas: Replicas, status: dict, now: float, settings=None):
    replicas.advance(now)
    settings = settings or EngineSettings(LoopState.from_status(status).max_num_seqs or 4)
    outcome = asyncio.run(
        loop.run_once("ns", "chat", SPEC, status, len(replicas.engines), settings, "secret")
    )
    status.update(outcome.status_patch)
    return outcome


def test_a_raise_is_applied_live_to_every_replica_and_written_where_the_builders_read_it():
    replicas = Replicas(2)
    replicas.load(40, 0.0)
    clock = [0.0]
    loop = ClosedLoop(replicas, replicas, clock=lambda: clock[0])
    status: dict = {}
    raised = None
    for t in range(0, 121, 15):
        clock[0] = float(t)
        outcome = run(loop, replicas, status, clock[0])
        if outcome.tuning.kind == "raise":
            raised = outcome
            break
    assert raised is not None, status.get("tuning")
    assert sorted(replicas.patches) == [("http://r0", 8), ("http://r1", 8)]
    assert ("MaxNumSeqsRaised", raised.tuning.reason) in raised.events
    tuning = status["tuning"]
    assert tuning[names.MAX_NUM_SEQS.crd_field] == 8
    assert tuning["lastDecision"] == "raise" and tuning["inputs"]["runningPerReplica"] == 4
    assert LoopState.from_status(status).max_num_seqs == 8
    assert status["metrics"]["queueLength"] > 0
    assert status["autoscaling"]["desiredReplicas"] >= 2


def test_a_restarted_operator_keeps_the_cooldown_and_history_from_status():
    replicas = Replicas(1)
    replicas.load(40, 0.0)
    clock = [0.0]
    loop = ClosedLoop(replicas, replicas, clock=lambda: clock[0])
    status: dict = {}
    for t in range(0, 121, 15):
        clock[0] = float(t)
        if run(loop, replicas, status, clock[0]).tuning.kind == "raise":
            break
    raised_at = clock[0]
    # A new operator process: fresh loop, no samples, only the status.
    restarted = ClosedLoop(replicas, replicas, clock=lambda: clock[0])
    for t in range(15, 120, 15):
        clock[0] = raised_at + t
        outcome = run(restarted, replicas, status, clock[0])
        assert outcome.tuning.kind == "hold" and "cooldown" in outcome.tuning.reason
    assert [h["kind"] for h in status["tuning"]["history"]] == ["raise"]


def test_a_stray_replica_is_repaired_and_an_unreachable_one_is_skipped_and_counted():
    replicas = Replicas(3, max_num_seqs=8)
    replicas.engines["http://r2"].max_num_seqs = 4  # started from an old template
    replicas.down.add("http://r1")
    loop = ClosedLoop(replicas, replicas, clock=lambda: 0.0)
    status = {"tuning": {names.MAX_NUM_SEQS.crd_field: 8}}
    outcome = run(loop, replicas, status, 0.0, EngineSettings(8))
    assert replicas.patches == [("http://r2", 8)]
    assert outcome.scraped == 2 and set(outcome.scrape_failures) == {"http://r1"}
    assert status["metrics"]["scrapeFailures"] == 1


def test_hand_edited_history_is_ignored_and_history_stays_bounded():
    replicas = Replicas(1)
    junk = [{"time": "yesterday", "kind": "raise"}]
    old = [
        {"time": f"2026-01-01T00:00:{i:02d}.000Z", "kind": "raise", "maxNumSeqs": 4,
         "previousMaxNumSeqs": 4, "kvCacheDtype": "auto", "reason": ""}
        for i in range(30)
    ]  # fmt: skip
    status = {"tuning": {"history": junk + old}}
    loop = ClosedLoop(replicas, replicas, clock=lambda: 2e9)
    run(loop, replicas, status, 0.0)
    assert len(status["tuning"]["history"]) == 20
