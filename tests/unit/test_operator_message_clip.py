"""What a tenant's replica answers reaches status and Events only clipped (bounds.clip, at
MAX_MESSAGE_CHARS): a 100 KB error text never grows an object by 100 KB, wherever it goes in
(the loop's status fields and Events, conditions, the adapters' status, posted Events)."""

from __future__ import annotations

import asyncio

import kopf
from aiohttp import web

from batchpilot import names
from batchpilot.operator import adapters, kube
from batchpilot.operator import status as s
from batchpilot.operator.bounds import MAX_MESSAGE_CHARS, clip
from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.admin_client import PATH, AdminClient, AdminError
from batchpilot.operator.loop.scrape import Scrape
from batchpilot.operator.loop.tuner_state import EngineSettings
from batchpilot.operator.loop.turn import ClosedLoop
from tests.support.loop import Replicas

HUGE = "E" * 100_000  # a replica's 100 KB error text
SPEC = parse_spec(
    {
        "engine": {"maxNumSeqs": 4},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 2, "max": 64}},
    }
)  # fmt: skip


class Hostile(Replicas):
    """Replicas whose failed scrapes and refused applies say 100 KB each."""

    async def scrape(self, namespace: str, name: str) -> list[Scrape]:
        return [
            Scrape(s.url, error=HUGE, admin_url=s.admin_url) if s.error else s
            for s in await super().scrape(namespace, name)
        ]

    async def set_live(self, urls, token: str, changes: dict) -> dict[str, str | None]:
        answers = await super().set_live(urls, token, changes)
        return {u: HUGE if why else None for u, why in answers.items()}


def strings(obj) -> list[str]:
    """Every string in a status patch, however deep."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in strings(v)]
    if isinstance(obj, list | tuple):
        return [x for v in obj for x in strings(v)]
    return []


def turn(replicas: Replicas, status: dict, settings: EngineSettings):
    loop = ClosedLoop(replicas, replicas, clock=lambda: 0.0)
    outcome = asyncio.run(
        loop.run_once("ns", "chat", SPEC, status, len(replicas.engines), settings, "secret")
    )
    assert all(len(x) <= MAX_MESSAGE_CHARS for x in strings(outcome.status_patch))
    assert all(len(m) <= MAX_MESSAGE_CHARS for _, m in outcome.events)
    return outcome


def test_clip_cuts_to_the_fixed_length_and_says_so():
    assert clip("short") == "short"
    assert clip("x" * MAX_MESSAGE_CHARS) == "x" * MAX_MESSAGE_CHARS
    clipped = clip(HUGE)
    assert len(clipped) == MAX_MESSAGE_CHARS and clipped.endswith("…")


def test_a_blind_loop_clips_the_replicas_errors_in_status_events_and_condition():
    replicas = Hostile(4)
    replicas.down.update({"http://r1", "http://r2", "http://r3"})
    status: dict = {}
    outcome = turn(replicas, status, EngineSettings(4))
    assert outcome.blind and "1 of 4 Ready replicas answered" in outcome.blind
    assert [r for r, _ in outcome.events] == ["LoopBlind"]
    status.update(outcome.status_patch)
    conditions = s.compute_status(
        name="chat", generation=1, prev=status, deployment=None, problem=None, url=None
    )["conditions"]
    (blind,) = [c for c in conditions if c["type"] == s.LOOP_BLIND]
    assert blind["status"] == "True" and len(blind["message"]) <= MAX_MESSAGE_CHARS


def test_a_held_scale_down_clips_the_errors_it_names():
    replicas = Hostile(2)
    replicas.down.add("http://r1")  # half answer: not blind, and the other asks for fewer
    outcome = turn(replicas, {}, EngineSettings(4))
    assert outcome.blind is None
    assert [r for r, _ in outcome.events if r == "ScaleDownHeld"] == ["ScaleDownHeld"]


def test_refused_applies_are_clipped_in_not_applied_and_the_event():
    replicas = Hostile(2, max_num_seqs=4)
    replicas.refusing.update(replicas.engines)
    status = {"tuning": {names.MAX_NUM_SEQS.crd_field: 8, names.KV_CACHE_DTYPE.crd_field: "auto"}}
    outcome = turn(replicas, status, EngineSettings(8))
    assert len(outcome.status_patch["tuning"]["notApplied"]) == 2
    assert [r for r, _ in outcome.events] == ["AdminApplyFailed"]


def test_what_a_replica_answers_back_is_clipped():
    """A 200 that reports a 60 KB value in force (under the byte limit): its failure, which
    status.tuning.notApplied carries, is clipped."""

    async def patch(request: web.Request) -> web.Response:
        return web.json_response({"max_num_seqs": "9" * 60_000})

    async def go() -> dict[str, str | None]:
        app = web.Application()
        app.router.add_patch(PATH, patch)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            return await AdminClient(timeout=5).set_live([url], "t", {"max_num_seqs": 8})
        finally:
            await runner.cleanup()

    (why,) = asyncio.run(go()).values()
    assert why.startswith("answered max_num_seqs=999") and len(why) <= MAX_MESSAGE_CHARS


def test_conditions_adapter_status_and_posted_events_are_clipped(monkeypatch):
    problem = s.Problem(s.INVALID_SPEC, HUGE)
    conditions = s.compute_status(
        name="chat", generation=1, prev=None, deployment=None, problem=problem, url=None
    )["conditions"]
    assert all(len(c["message"]) <= MAX_MESSAGE_CHARS for c in conditions)
    assert len(adapters._why(AdminError(HUGE))) <= MAX_MESSAGE_CHARS
    posted = []
    monkeypatch.setattr(kopf, "event", lambda body, **kw: posted.append(kw["message"]))
    kube.post_event({"metadata": {}}, "Warning", "AdminApplyFailed", HUGE)
    assert posted == [clip(HUGE)]
