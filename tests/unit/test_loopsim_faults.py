"""benchmarks/loopsim's faults and actuation: scrapes dropped at the stated rate, a blind
replica, a replica whose admin API refuses changes, and the service's side of the
contract (live changes only through the admin fake, status reaching new pods, a KV dtype
change rolling the replicas either way)."""

from __future__ import annotations

import asyncio

from batchpilot.operator.crd.spec import parse_spec
from benchmarks.loopsim import Faults, ReplicaConfig, ServiceSim, steady
from benchmarks.loopsim.faults import ALL, BLIND, DROPPED, REJECTED
from benchmarks.loopsim.service import _SimAdmin, _SimSource


def service(faults: Faults = Faults(), replicas: int = 3, **tuning) -> ServiceSim:
    spec = parse_spec(
        {"engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": 512},
         "tuning": {"enabled": True, "maxNumSeqs": {"min": 4, "max": 32}, **tuning}}
    )  # fmt: skip
    sim = ServiceSim(spec, ReplicaConfig(), replicas=replicas, faults=faults)
    sim._reset(seed=7)
    return sim


def scrape(sim: ServiceSim):
    return asyncio.run(_SimSource(sim).scrape("sim", "service"))


def test_three_in_ten_scrapes_are_dropped_at_random():
    sim = service(Faults(drop_fraction=0.3), replicas=3)
    rounds = [scrape(sim) for _ in range(400)]
    errors = [s.error for r in rounds for s in r]
    dropped = errors.count(DROPPED) / len(errors)
    assert 0.26 < dropped < 0.34, dropped
    assert set(errors) == {None, DROPPED}
    # Dropped at random: every replica loses some, none loses all.
    for url in ("sim://replica-0", "sim://replica-1", "sim://replica-2"):
        mine = [s.error for r in rounds for s in r if s.url == url]
        assert 0.2 < mine.count(DROPPED) / len(mine) < 0.4


def test_the_blind_replica_never_answers_and_the_others_always_do():
    sim = service(Faults(blind=("sim://replica-0",)), replicas=2)
    for _ in range(50):
        by_url = {s.url: s for s in scrape(sim)}
        assert by_url["sim://replica-0"].error == BLIND
        assert by_url["sim://replica-1"].error is None and by_url["sim://replica-1"].text


def test_a_rejecting_replica_refuses_live_changes_and_keeps_its_settings():
    sim = service(Faults(rejecting=("sim://replica-1",)), replicas=2)
    urls = [p.engine.url for p in sim.pods]
    answer = asyncio.run(
        _SimAdmin(sim).set_live(urls, "t", {"max_num_seqs": 16, "max_num_batched_tokens": 256})
    )
    assert answer == {"sim://replica-0": None, "sim://replica-1": REJECTED}
    first, second = (p.engine for p in sim.pods)
    assert (first.max_num_seqs, first.max_num_batched_tokens) == (16, 256)
    assert (second.max_num_seqs, second.max_num_batched_tokens) == (8, 512)


def test_status_reaches_new_pods_and_a_tuned_budget_starts_at_its_range_max():
    sim = service(maxNumBatchedTokens={"min": 128, "max": 1024})
    status = {"tuning": {"maxNumSeqs": 24, "kvCacheDtype": "auto", "maxNumBatchedTokens": 256}}
    config = sim._template(status)
    assert config.max_num_seqs == 24
    # The Deployment builder's: the template carries the range's max, the loop sets the
    # tuned budget live, so a budget change rolls nothing.
    assert config.max_num_batched_tokens == 1024
    assert sim.settings(status).max_num_batched_tokens == 256


def test_an_fp8_switch_and_the_switch_back_both_roll_every_replica():
    sim = service(replicas=2, allowFP8KVCache=True)
    sim._result = None
    auto = {"tuning": {"maxNumSeqs": 8, "kvCacheDtype": "auto"}}
    fp8 = {"tuning": {"maxNumSeqs": 8, "kvCacheDtype": "fp8"}}
    for before, after, dtype in ((auto, fp8, "fp8"), (fp8, auto, "auto")):
        old = list(sim.pods)
        assert sim.settings(after).kv_cache_dtype != sim.settings(before).kv_cache_dtype
        sim._roll(after)
        new = [p for p in sim.pods if p not in old]
        assert len(new) == 2 and all(p.engine.kv_cache_dtype == dtype for p in new)
        sim.now = max(p.ready_at for p in new)
        sim._finish_roll()
        assert all(p.draining for p in old)
        sim.pods = new  # the old ones have drained


def test_no_scale_down_rests_on_a_failed_scrape():
    """Issue 20's three faults on two replicas under twice one replica's load, with
    autoscaling and tuning from a max_num_seqs whose queue makes the tuner send live changes:
    the run records each ScaledDown posted in a turn where a Ready replica's scrape had
    failed."""
    spec = parse_spec(
        {"engine": {"maxNumSeqs": 4},
         "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
         "tuning": {"enabled": True, "maxNumSeqs": {"min": 2, "max": 32}}}
    )  # fmt: skip
    faulty = ServiceSim(spec, ReplicaConfig(), replicas=2, faults=ALL).run(
        steady(1.0), duration=1800, seed=4
    )
    assert sum(p.scrape_failures for p in faulty.trace) > len(faulty.trace)  # blind + 30%
    assert faulty.scale_downs_on_failed_scrapes == 0
    assert faulty.reasons()["AdminApplyFailed"] > 0  # the rejecting replica said no
