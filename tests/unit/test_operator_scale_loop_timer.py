"""What keeps the loop turning at 1,000 services (benchmarks/operator_scale): a turn's
blocking calls never queue behind asyncio's default executor (which the turns' full
reconciles once filled), and turns beyond TURN_SLOTS wait their turn, first come first
served, with the wait counted and a warning when it stretches the loop interval."""

from __future__ import annotations

import asyncio
import logging
import threading

from batchpilot.operator.config import OperatorConfig
from batchpilot.operator.loop import timer as timer_module
from batchpilot.operator.loop.admin_client import AdminClient
from batchpilot.operator.loop.timer import TURN_WAIT, LoopTimer
from batchpilot.operator.loop.turn import ClosedLoop
from batchpilot.operator.reconcile import Reconciler
from tests.support.fake_kube import KEY as ADMIN_KEY
from tests.support.fake_kube import NS, FakeKube, QueuedSource

AUTOSCALING = {"enabled": True, "minReplicas": 2, "maxReplicas": 2}


class SlowSource(QueuedSource):
    """QueuedSource whose scrape takes a while, counting the scrapes in flight."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.in_flight = self.most = 0

    async def scrape(self, namespace, name):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(self.seconds)
        self.in_flight -= 1
        return await super().scrape(namespace, name)


def made(names: list[str], source, **config) -> tuple[LoopTimer, FakeKube]:
    config = OperatorConfig(server_image="img:1", admin_key=ADMIN_KEY, **config)
    rec = Reconciler(config, kube=FakeKube())
    for name in names:
        rec.reconcile(rec.kube.add_isvc(name, {"replicas": 2, "autoscaling": AUTOSCALING}))
    return LoopTimer(config, rec, ClosedLoop(source, AdminClient())), rec.kube


def test_a_turn_does_not_wait_for_the_default_executor():
    timer, kube = made(["chat"], QueuedSource())

    async def turn_beside_a_full_default_executor() -> None:
        loop = asyncio.get_running_loop()
        release = threading.Event()
        # More blocked jobs than the default executor has threads (min(32, cores + 4)).
        blocked = [loop.run_in_executor(None, release.wait, 30) for _ in range(40)]
        try:
            await asyncio.wait_for(timer.tick(kube.read_isvc(NS, "chat")), timeout=10)
        finally:
            release.set()
            await asyncio.gather(*blocked)

    asyncio.run(turn_beside_a_full_default_executor())
    assert kube.status("chat")["autoscaling"]["desiredReplicas"] == 2


def test_turns_past_the_slots_wait_their_turn_and_the_wait_is_told(monkeypatch, caplog):
    monkeypatch.setattr(timer_module, "TURN_SLOTS", 2)
    source = SlowSource(0.3)
    services = [f"svc-{i}" for i in range(6)]
    timer, kube = made(services, source, loop_interval=0.2)

    async def all_at_once() -> None:
        await asyncio.gather(*(timer.tick(kube.read_isvc(NS, n)) for n in services))

    with caplog.at_level(logging.WARNING, logger="batchpilot.operator.loop"):
        asyncio.run(all_at_once())
    assert source.most == 2  # never more turns at once than the slots
    assert all(kube.status(n)["autoscaling"]["desiredReplicas"] == 2 for n in services)
    assert TURN_WAIT._value.get() >= 0.5  # the last turn waited for two rounds of two
    behind = [r for r in caplog.records if "loop behind" in r.getMessage()]
    assert len(behind) == 1, caplog.records  # said once, not per turn


def test_a_service_never_reconciled_costs_its_turn_no_request():
    timer, kube = made([], QueuedSource())
    body = kube.add_isvc("new", {"replicas": 2, "autoscaling": AUTOSCALING})
    kube.calls.clear()
    asyncio.run(timer.tick(body))  # made a moment ago: the reconcile has not run yet
    assert kube.calls == []
    timer.rec.reconcile(body)
    kube.calls.clear()
    asyncio.run(timer.tick(kube.read_isvc(NS, "new")))
    assert kube.status("new")["autoscaling"]["desiredReplicas"] == 2


def test_a_first_decision_the_deployment_already_runs_costs_no_reconcile():
    timer, kube = made(["chat"], QueuedSource())
    kube.calls.clear()
    asyncio.run(timer.tick(kube.read_isvc(NS, "chat")))
    assert kube.status("chat")["autoscaling"]["desiredReplicas"] == 2  # as the Deployment
    applies = [c for c in kube.calls if c[0] == "apply"]
    assert applies == [], "the turn reconciled what the Deployment already runs"
    # The timer's check sees the new loop state in status, builds the children from it and
    # finds them as applied: no full reconcile (before, one: 13 requests per service).
    kube.calls.clear()
    for _ in range(2):
        timer.rec.resync_by_name(NS, "chat", kube.read_isvc(NS, "chat"))
    assert kube.calls == []
