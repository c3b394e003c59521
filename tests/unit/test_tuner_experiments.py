"""The keep-or-revert judge (judge.py) and the tuner's flows (tune.decide_tuning): every
engine change is tried, judged against a baseline at equal load, kept or reverted, and
remembered with a back-off. Windows are built by hand; a tiny plant drives the loop over
hours where the answer must be "no ratchet"."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from batchpilot.operator.crd.spec import parse_spec
from batchpilot.operator.loop.judge import (
    JudgeLimits,
    Targets,
    judge,
    misses_slo,
    score,
    share_within,
)
from batchpilot.operator.loop.observe import Window, merge_windows
from batchpilot.operator.loop.state import TunerState
from batchpilot.operator.loop.tune import View, decide_tuning
from batchpilot.operator.loop.tune_rules import TuneLimits
from batchpilot.operator.loop.tuner_state import EngineSettings, Move, Score, Verdict
from batchpilot.operator.loop.turn import live_targets

R0, R1, R2, R3 = (f"http://r{i}" for i in range(4))
AT8 = EngineSettings(8, "auto")
TARGETS = Targets(ttft_seconds=2.0, itl_seconds=0.1)
SPEC = parse_spec(
    {
        "engine": {"maxNumSeqs": 8},
        "slo": {"interTokenLatencySeconds": 0.1, "timeToFirstTokenSeconds": 2.0},
        "tuning": {"enabled": True, "maxNumSeqs": {"min": 2, "max": 64}, "cooldownSeconds": 120},
    }
)
FP8_SPEC = parse_spec(
    {
        "engine": {"maxNumSeqs": 8},
        "slo": {"interTokenLatencySeconds": 0.1, "timeToFirstTokenSeconds": 2.0},
        "tuning": {
            "enabled": True,
            "maxNumSeqs": {"min": 2, "max": 64},
            "allowFP8KVCache": True,
            "cooldownSeconds": 120,
        },
    }
)
BUDGET_SPEC = parse_spec(
    {
        "engine": {"maxNumSeqs": 8},
        "slo": {"interTokenLatencySeconds": 0.1, "timeToFirstTokenSeconds": 2.0},
        "tuning": {
            "enabled": True,
            "maxNumSeqs": {"min": 2, "max": 64},
            "maxNumBatchedTokens": {"min": 256, "max": 4096},
            "cooldownSeconds": 120,
        },
    }
)


def hist(p99: float | None, n: float) -> tuple:
    """A cumulative histogram of ``n`` observations spread evenly over [0, p99 / 0.99]:
    its P99 is ``p99`` and the share under t < p99 / 0.99 is 0.99 t / p99."""
    if p99 is None or n <= 0:
        return ()
    return ((0.0, 0.0), (p99 / 0.99, float(n)), (math.inf, float(n)))


def replica(
    url: str = R0,
    *,
    settings: EngineSettings | None = AT8,
    running=6.0,
    waiting=0.0,
    kv=0.3,
    kv_peak=None,
    preemptions=0.0,
    tokens=100.0,
    itl=0.05,
    ttft=0.5,
    samples=1000,
    span=60.0,
) -> Window:
    """One replica's window; ``settings`` is what it reports running (None: nothing)."""
    s = settings
    return Window(
        replicas=1,
        span_seconds=span,
        waiting=waiting,
        running=running,
        swapped=0.0,
        kv_cache_usage=kv,
        kv_cache_usage_peak=kv if kv_peak is None else kv_peak,
        preemptions_per_minute=preemptions,
        swaps_per_minute=0.0,
        generation_tokens_per_second=tokens,
        waiting_now=waiting,
        running_now=running,
        ttft_buckets=hist(ttft, samples),
        itl_buckets=hist(itl, samples),
        max_num_seqs={url: s.max_num_seqs} if s else {},
        max_num_batched_tokens={url: s.max_num_batched_tokens}
        if s and s.max_num_batched_tokens
        else {},
        kv_cache_dtype={url: s.kv_cache_dtype} if s else {},
    )


def replicas(n: int, **kw) -> dict[str, Window]:
    return {f"http://r{i}": replica(f"http://r{i}", **kw) for i in range(n)}


def view(reps: dict[str, Window]) -> View:
    return View(service=merge_windows(list(reps.values())), replicas=reps)


def turn(reps, state=TunerState(), now=1000.0, spec=SPEC, in_force=AT8, limits=TuneLimits()):
    return decide_tuning(view(reps), spec, state, in_force, now, limits)


def sc(goodput, throughput, waiting=0.0, itl=0.05, ttft=0.5, samples=1000, seconds=60.0):
    return Score(goodput, throughput, waiting, itl, ttft, samples, seconds)


# --------------------------------------------------------------------------- the rule


def test_a_queue_past_every_target_is_judged_on_throughput_that_drains_it():
    targets = Targets(ttft_seconds=2.0, itl_seconds=0.1)
    # Nothing met the TTFT target in either window (queueing): goodput 0 -> 0.
    before = sc(0.0, 100.0, waiting=20, ttft=40.0)
    keep, why = judge(before, sc(0.0, 150.0, waiting=12, ttft=30.0), targets,
                      slo_missed=True, toward_default=False)  # fmt: skip
    assert keep and why.startswith("throughput"), why
    keep, why = judge(before, sc(0.0, 90.0, waiting=25, ttft=50.0), targets,
                      slo_missed=True, toward_default=False)  # fmt: skip
    assert not keep and why.startswith("throughput"), why
    # Without a queue, missing the targets is not the queue's doing: no throughput escape.
    keep, _ = judge(sc(0.0, 100.0, ttft=40.0), sc(0.0, 150.0, ttft=30.0), targets,
                    slo_missed=True, toward_default=False)  # fmt: skip
    assert not keep


def test_share_within_interpolates_inside_the_bucket_that_holds_the_target():
    buckets = ((0.1, 50.0), (0.2, 100.0), (math.inf, 100.0))
    assert share_within(buckets, 0.15) == pytest.approx(0.75)
    assert share_within(buckets, 0.1) == pytest.approx(0.5)
    assert share_within(buckets, 0.05) == pytest.approx(0.25)  # the first bucket starts at 0
    assert share_within(buckets, 0.0) == 0.0
    assert share_within(buckets, 0.3) == pytest.approx(1.0)
    # Observations past the last finite bound are all counted as missing it.
    assert share_within(((0.1, 50.0), (math.inf, 100.0)), 0.5) == pytest.approx(0.5)


def test_share_within_an_empty_histogram_is_one():
    assert share_within((), 0.1) == 1.0
    assert share_within(((0.1, 0.0), (math.inf, 0.0)), 0.1) == 1.0


def test_score_is_per_replica_goodput_within_both_targets():
    w = merge_windows(
        [replica(R0, tokens=100, itl=0.2, ttft=0.5), replica(R1, tokens=100, itl=0.2, ttft=0.5)]
    )
    s = score(w, TARGETS)
    assert s.throughput == pytest.approx(100)  # 200 tokens/s over two replicas
    assert s.goodput == pytest.approx(100 * 0.1 * 0.99 / 0.2)  # ITL share 0.495, TTFT share 1
    assert s.itl_p99 == pytest.approx(0.2) and s.samples == 2000
    # A missed TTFT target counts too.
    slow_first = score(replica(ttft=4.0), TARGETS)
    assert slow_first.goodput == pytest.approx(100 * 2.0 * 0.99 / 4.0)
    assert misses_slo(slow_first, TARGETS) and not misses_slo(score(replica(), TARGETS), TARGETS)


def test_saturated_windows_compare_goodput():
    # Both had a queue: the replicas ran flat out, so goodput compares directly, even
    # though the share within the SLO fell (attainment 1.0 -> 0.55).
    before, after = sc(100, 100, waiting=2), sc(110, 200, waiting=2)
    keep, why = judge(before, after, TARGETS, slo_missed=False, toward_default=False)
    assert keep and "goodput" in why
    keep, why = judge(
        sc(100, 100, 2), sc(90, 90, 2), TARGETS, slo_missed=False, toward_default=False
    )
    assert not keep and "goodput" in why


def test_unsaturated_windows_compare_attainment_at_equal_offered_load():
    # More arrived after the change: goodput rose 1.5x, attainment did not move. Not better.
    keep, why = judge(sc(100, 100), sc(150, 150), TARGETS, slo_missed=False, toward_default=False)
    assert not keep and "attainment" in why
    # Less arrived, but every token met the SLO where a fifth missed: better, though
    # goodput fell.
    keep, why = judge(sc(80, 100), sc(60, 60), TARGETS, slo_missed=False, toward_default=False)
    assert keep and "better" in why
    # One of the two windows without a queue is enough to compare attainment.
    keep, _ = judge(
        sc(100, 100, waiting=3),
        sc(150, 150, waiting=0),
        TARGETS,
        slo_missed=False,
        toward_default=False,
    )
    assert not keep


def test_a_change_must_gain_the_minimum():
    base = sc(100, 100, waiting=2)
    assert not judge(base, sc(102, 102, 2), TARGETS, slo_missed=False, toward_default=False)[0]
    assert judge(base, sc(104, 104, 2), TARGETS, slo_missed=False, toward_default=False)[0]
    strict = JudgeLimits(min_gain=0.1)
    assert not judge(
        base, sc(105, 105, 2), TARGETS, slo_missed=False, toward_default=False, limits=strict
    )[0]


def test_restoring_a_missed_latency_target_is_kept_within_the_tolerance():
    before = sc(100, 100, waiting=2, itl=0.2)
    restored = sc(97, 97, waiting=2, itl=0.09)
    keep, why = judge(before, restored, TARGETS, slo_missed=True, toward_default=False)
    assert keep and "met again" in why
    # The same numbers when no target was missed before: a loss, reverted.
    assert not judge(before, restored, TARGETS, slo_missed=False, toward_default=False)[0]
    # Restored, but at a cost over the tolerance.
    costly = sc(90, 90, waiting=2, itl=0.09)
    assert not judge(before, costly, TARGETS, slo_missed=True, toward_default=False)[0]
    # Still missing it.
    still = sc(97, 97, waiting=2, itl=0.15)
    assert not judge(before, still, TARGETS, slo_missed=True, toward_default=False)[0]


def test_a_change_back_toward_the_spec_is_kept_when_no_worse():
    before, after = sc(100, 100, 2), sc(98, 98, 2)
    keep, why = judge(before, after, TARGETS, slo_missed=False, toward_default=True)
    assert keep and "spec" in why
    assert not judge(before, after, TARGETS, slo_missed=False, toward_default=False)[0]
    assert not judge(before, sc(90, 90, 2), TARGETS, slo_missed=False, toward_default=True)[0]


# --------------------------------------------------------------------------- canary


def started_canary(now=1000.0):
    """Two slot-bound replicas with latency headroom: a raise 8 -> 16 on r0."""
    return turn(replicas(2, running=8, waiting=5, kv=0.1), now=now)


def canary_result(tokens: float, *, span=60.0, samples=1000, after=EngineSettings(16)):
    return {
        R0: replica(
            R0,
            settings=after,
            running=14,
            waiting=5,
            kv=0.2,
            tokens=tokens,
            span=span,
            samples=samples,
        ),
        R1: replica(
            R1, settings=AT8, running=8, waiting=5, kv=0.1, tokens=100, span=span, samples=samples
        ),
    }


def test_slot_bound_with_two_replicas_tries_the_raise_on_one_replica_first():
    d, st = started_canary()
    assert (d.action, d.kind) == ("canary", "raise")
    assert d.settings == AT8 and st.settings == AT8  # in force everywhere else: unchanged
    e = st.experiment
    assert e is not None and e.canary == R0 and e.baseline is None
    assert (e.before, e.after, e.started) == (AT8, EngineSettings(16), 1000.0)
    assert st.history[-1].action == "canary" and st.history[-1].kind == "raise"
    assert live_targets(st, [R0, R1]) == {R0: EngineSettings(16), R1: AT8}


def test_a_canary_is_judged_only_after_the_minimum_window_and_samples():
    _, st = started_canary()
    d, st2 = turn(canary_result(150, span=10), st, now=1010)
    assert d.action == "hold" and "judging" in d.reason and st2.experiment == st.experiment
    d, st2 = turn(canary_result(150, samples=100), st, now=1060)
    assert d.action == "hold" and "100 ITL observations" in d.reason
    assert st2.experiment == st.experiment


def test_a_better_canary_is_rolled_out():
    _, st = started_canary()
    d, st = turn(canary_result(150), st, now=1060)
    assert (d.action, d.kind) == ("rollout", "raise")
    assert d.settings == EngineSettings(16) and st.settings == EngineSettings(16)
    assert st.experiment is None
    assert d.before.throughput == pytest.approx(100) and d.after.throughput == pytest.approx(150)
    (v,) = st.verdicts
    assert v.settings == Move(AT8, "raise").key and v.kept and not v.blocks(1061)
    assert live_targets(st, [R0, R1]) == {R0: EngineSettings(16), R1: EngineSettings(16)}


def test_a_worse_canary_is_reverted_and_its_retry_backs_off():
    lim = TuneLimits()
    _, st = started_canary()
    d, st = turn(canary_result(80), st, now=1060)
    assert (d.action, d.kind) == ("revert", "raise")
    assert d.settings == AT8 and st.settings == AT8 and st.experiment is None
    # Judged at 13 requests in the system per replica (the control's 8 running, 5 waiting).
    assert st.verdicts == (
        Verdict(Move(AT8, "raise").key, False, 1060, 1, 1060 + lim.retry_seconds, 13.0),
    )
    # After the cooldown the same raise is still asked for, and refused while blocked.
    d, st = turn(replicas(2, running=8, waiting=5, kv=0.1), st, now=1500)
    assert d.action == "hold" and "rejected 1 time(s)" in d.reason and st.experiment is None
    # Past its retry time, at the same load, the answer would be the same: still refused.
    t = 1060 + lim.retry_seconds
    d, st = turn(replicas(2, running=8, waiting=5, kv=0.1), st, now=t)
    assert d.action == "hold" and "rejected" in d.reason
    # At another load (18 in the system, +38%) it is tried again (a re-probe) ...
    d, st = turn(replicas(2, running=8, waiting=10, kv=0.1), st, now=t)
    assert (d.action, d.kind) == ("canary", "raise")
    # ... and a second rejection in a row doubles the wait.
    d, st = turn(canary_result(80), st, now=t + 60)
    assert d.action == "revert"
    (v,) = st.verdicts
    assert (v.strikes, v.until) == (2, t + 60 + 2 * lim.retry_seconds)


def test_a_blocked_candidate_gives_way_to_the_next_one():
    # ITL over target with TTFT headroom: a lower budget first, then a lower max_num_seqs.
    settings = EngineSettings(8, "auto", 2048)
    slow = replicas(1, settings=settings, running=6, itl=0.2, ttft=0.5)
    d, _ = turn(slow, TunerState(settings=settings), spec=BUDGET_SPEC, in_force=settings)
    assert d.kind == "lower_budget"
    blocked = TunerState(settings=settings).judged(
        Move(settings, "lower_budget"), False, 900.0, 900.0, 4 * 3600.0
    )
    d, st = turn(slow, blocked, spec=BUDGET_SPEC, in_force=settings)
    assert (d.kind, st.experiment.after) == ("lower", EngineSettings(4, "auto", 2048))


# --------------------------------------------------------------------------- single replica


def test_one_replica_tries_the_change_on_the_service_against_a_baseline():
    d, st = turn(replicas(1, running=8, waiting=5, kv=0.1))
    assert (d.action, d.kind) == ("try", "raise")
    assert d.settings == EngineSettings(16) and st.settings == EngineSettings(16)
    e = st.experiment
    assert e.canary is None and e.baseline is not None
    assert (e.baseline.throughput, e.baseline.waiting) == (pytest.approx(100), pytest.approx(5))
    kept, st_kept = turn(
        {R0: replica(R0, settings=EngineSettings(16), running=14, waiting=5, tokens=130)},
        st,
        now=1060,
    )
    assert kept.action == "keep" and st_kept.settings == EngineSettings(16)
    reverted, st_rev = turn(
        {R0: replica(R0, settings=EngineSettings(16), running=14, waiting=5, tokens=90)},
        st,
        now=1060,
    )
    assert reverted.action == "revert" and st_rev.settings == AT8


def test_the_after_window_counts_only_replicas_running_the_change():
    # fp8 restarts pods: it runs on every replica at once, judged against the baseline.
    memory = replicas(2, running=6, waiting=2, preemptions=30, kv=0.9)
    d, st = turn(memory, spec=FP8_SPEC)
    assert (d.action, d.kind) == ("try", "fp8") and st.experiment.canary is None
    fp8 = EngineSettings(8, "fp8")
    # Nobody reports fp8 yet: nothing to judge.
    d, st2 = turn(replicas(2, running=6, waiting=2), st, now=1060, spec=FP8_SPEC)
    assert d.action == "hold" and "no replica runs the change" in d.reason
    assert st2.experiment == st.experiment
    # r0 restarted with fp8 and does well; r1, still on the old dtype, does badly. Only r0
    # is the change's evidence (with r1 in, the mean would be 80 < 100: a revert).
    mixed = {
        R0: replica(R0, settings=fp8, running=6, waiting=2, tokens=150),
        R1: replica(R1, settings=AT8, running=6, waiting=2, tokens=10),
    }
    d, st3 = turn(mixed, st, now=1060, spec=FP8_SPEC)
    assert d.action == "keep" and st3.settings == fp8
    assert d.after.throughput == pytest.approx(150)


# --------------------------------------------------------------------------- fp8


def test_memory_bound_on_the_worst_replica_tries_fp8_though_the_mean_is_under_the_bound():
    # r0: 18 preemptions a minute at 100 tokens/s, 3 per 1,000 tokens; the others none.
    reps = replicas(4, running=6)
    reps[R0] = replica(R0, running=6, preemptions=18, tokens=100)
    service = merge_windows(list(reps.values()))
    mean = 1000 * service.preemptions_per_minute / 60 / service.generation_tokens_per_second
    assert mean < TuneLimits().thrash_per_1k_tokens
    d, st = turn(reps, spec=FP8_SPEC)
    assert (d.action, d.kind) == ("try", "fp8")
    assert d.settings == EngineSettings(8, "fp8")
    assert d.inputs["thrashPer1kTokensWorstReplica"] == pytest.approx(3.0)
    # Without fp8 allowed the same replica asks for a lower, tried on a canary.
    d, st = turn(reps, spec=SPEC)
    assert (d.action, d.kind) == ("canary", "lower")
    assert st.experiment.after == EngineSettings(4)  # 0.75 x the 6 running


def test_fp8_is_reversible_when_the_cache_would_fit_in_16_bits():
    fp8 = EngineSettings(8, "fp8")
    quiet = replicas(1, settings=fp8, running=3, waiting=0, kv=0.1, kv_peak=0.2)
    d, st = turn(quiet, TunerState(settings=fp8), spec=FP8_SPEC, in_force=fp8)
    assert (d.action, d.kind) == ("try", "fp8_off") and d.settings == AT8
    # Judged: a little lower but within the tolerance, and back toward the spec: kept.
    after = {R0: replica(R0, settings=AT8, running=3, kv=0.2, itl=0.05, tokens=100)}
    d, st = turn(after, st, now=1060, spec=FP8_SPEC)
    assert d.action == "keep" and st.settings == AT8
    # A full cache or a queue keeps fp8.
    full = replicas(1, settings=fp8, running=3, waiting=0, kv=0.3, kv_peak=0.6)
    assert turn(full, TunerState(settings=fp8), spec=FP8_SPEC, in_force=fp8)[0].action == "hold"


def test_a_reverted_fp8_goes_back_to_auto():
    memory = replicas(1, running=6, preemptions=30, kv=0.9)
    d, st = turn(memory, spec=FP8_SPEC)
    assert d.kind == "fp8" and st.settings.kv_cache_dtype == "fp8"
    worse = {R0: replica(R0, settings=EngineSettings(8, "fp8"), running=6, itl=0.2)}
    d, st = turn(worse, st, now=1060, spec=FP8_SPEC)
    assert (d.action, d.kind) == ("revert", "fp8")
    assert st.settings == AT8 and st.settings.kv_cache_dtype == "auto"
    assert st.blocked(Move(AT8, "fp8"), 1061) is not None


# --------------------------------------------------------------------------- budget


def test_itl_over_target_with_ttft_headroom_lowers_the_budget_first():
    s = EngineSettings(8, "auto", 2048)
    slow = replicas(1, settings=s, running=6, itl=0.2, ttft=0.5)
    d, _st = turn(slow, TunerState(settings=s), spec=BUDGET_SPEC, in_force=s)
    assert (d.kind, d.settings) == ("lower_budget", EngineSettings(8, "auto", 1024))
    # Without TTFT headroom a lower max_num_seqs comes first.
    tight = replicas(1, settings=s, running=6, itl=0.2, ttft=1.5)
    d, _ = turn(tight, TunerState(settings=s), spec=BUDGET_SPEC, in_force=s)
    assert (d.kind, d.settings) == ("lower", EngineSettings(4, "auto", 2048))


def test_a_budget_change_on_several_replicas_is_a_live_canary():
    s = EngineSettings(8, "auto", 2048)
    slow = replicas(2, settings=s, running=6, itl=0.2, ttft=0.5)
    d, st = turn(slow, TunerState(settings=s), spec=BUDGET_SPEC, in_force=s)
    assert (d.action, d.kind) == ("canary", "lower_budget") and d.settings == s
    assert st.experiment.after.max_num_batched_tokens == 1024
    assert live_targets(st, [R0, R1])[R0].live_changes(s) == {"max_num_batched_tokens": 1024}


def test_ttft_over_target_with_itl_headroom_raises_the_budget():
    s = EngineSettings(8, "auto", 1024)
    slow_first = replicas(1, settings=s, running=6, itl=0.05, ttft=3.0)
    d, _ = turn(slow_first, TunerState(settings=s), spec=BUDGET_SPEC, in_force=s)
    assert (d.kind, d.settings) == ("raise_budget", EngineSettings(8, "auto", 2048))
    # Without ITL headroom the budget stays.
    both = replicas(1, settings=s, running=6, itl=0.09, ttft=3.0)
    assert turn(both, TunerState(settings=s), spec=BUDGET_SPEC, in_force=s)[0].action == "hold"


def test_budget_moves_stay_within_the_range_and_over_max_num_seqs():
    top = EngineSettings(8, "auto", 4096)
    d, _ = turn(
        replicas(1, settings=top, itl=0.05, ttft=3.0),
        TunerState(settings=top),
        spec=BUDGET_SPEC,
        in_force=top,
    )
    assert d.action == "hold"  # already at the range's max
    near = EngineSettings(8, "auto", 3000)
    d, _ = turn(
        replicas(1, settings=near, itl=0.05, ttft=3.0),
        TunerState(settings=near),
        spec=BUDGET_SPEC,
        in_force=near,
    )
    assert d.settings.max_num_batched_tokens == 4096  # 6000, clamped to the max
    bottom = EngineSettings(8, "auto", 256)
    d, _ = turn(
        replicas(1, settings=bottom, itl=0.2, ttft=0.5),
        TunerState(settings=bottom),
        spec=BUDGET_SPEC,
        in_force=bottom,
    )
    assert d.kind == "lower"  # no budget under the range's min
    wide = parse_spec(
        {
            "engine": {"maxNumSeqs": 48},
            "slo": {"interTokenLatencySeconds": 0.1},
            "tuning": {
                "enabled": True,
                "maxNumSeqs": {"min": 2, "max": 64},
                "maxNumBatchedTokens": {"min": 16, "max": 4096},
            },
        }
    )
    s = EngineSettings(48, "auto", 80)
    d, _ = turn(
        replicas(1, settings=s, running=30, itl=0.2, ttft=0.5),
        TunerState(settings=s),
        spec=wide,
        in_force=s,
    )
    assert d.kind == "lower_budget" and d.settings.max_num_batched_tokens == 48  # not 40


def test_a_budget_range_under_max_num_seqs_never_moves_the_budget_out_of_it():
    # tuning.maxNumBatchedTokens {16, 32} with max_num_seqs 64: no budget both >= 64 and
    # within the range exists. A "lower" budget must never raise it, nor leave the range.
    spec = parse_spec(
        {
            "engine": {"maxNumSeqs": 64},
            "slo": {"interTokenLatencySeconds": 0.1},
            "tuning": {
                "enabled": True,
                "maxNumSeqs": {"min": 2, "max": 64},
                "maxNumBatchedTokens": {"min": 16, "max": 32},
            },
        }
    )
    s = EngineSettings(64, "auto", 32)
    slow = replicas(1, settings=s, running=30, itl=0.2, ttft=0.5)
    d, _ = turn(slow, TunerState(settings=s), spec=spec, in_force=s)
    assert d.kind != "lower_budget" or d.settings.max_num_batched_tokens < 32
    assert 16 <= d.settings.max_num_batched_tokens <= 32


def test_without_a_budget_range_there_are_no_budget_candidates():
    s = EngineSettings(8, "auto", 2048)
    slow = replicas(1, settings=s, running=6, itl=0.2, ttft=0.5)
    d, _ = turn(slow, TunerState(settings=s), spec=SPEC, in_force=s)
    assert d.kind == "lower" and d.settings.max_num_batched_tokens == 2048
    slow_first = replicas(1, settings=s, running=6, itl=0.05, ttft=3.0)
    assert turn(slow_first, TunerState(settings=s), spec=SPEC, in_force=s)[0].action == "hold"


# --------------------------------------------------------------------------- abandon, holds


def test_a_canary_that_stops_answering_is_abandoned_without_a_verdict():
    _, st = started_canary()
    only_r1 = {R1: replica(R1, running=8, waiting=5)}
    d, st2 = turn(only_r1, st, now=1060)
    assert (d.action, d.kind) == ("abandon", "raise")
    assert d.settings == AT8 and st2.settings == AT8 and st2.experiment is None
    assert st2.verdicts == ()
    # Also when the canary does not run the change (its apply failed).
    d, st3 = turn(canary_result(150, after=AT8), st, now=1060)
    assert d.action == "abandon" and st3.verdicts == () and st3.settings == AT8


def test_a_trial_without_evidence_is_abandoned_after_the_maximum():
    lim = TuneLimits()
    _, st = turn(replicas(1, running=8, waiting=5, kv=0.1))
    sparse = {R0: replica(R0, settings=EngineSettings(16), samples=100, waiting=5)}
    d, st2 = turn(sparse, st, now=1000 + lim.max_experiment_seconds - 1)
    assert d.action == "hold" and st2.experiment == st.experiment
    d, st2 = turn(sparse, st, now=1000 + lim.max_experiment_seconds + 1)
    assert d.action == "abandon" and "no verdict" in d.reason
    assert st2.settings == AT8 and st2.verdicts == () and st2.experiment is None


def test_cooldown_after_a_change():
    _, st = turn(replicas(1, running=8, waiting=5, kv=0.1))
    d, st = turn(
        {R0: replica(R0, settings=EngineSettings(16), waiting=5, tokens=150)}, st, now=1060
    )
    assert d.action == "keep"
    s16 = EngineSettings(16)
    busy = replicas(1, settings=s16, running=16, waiting=5, kv=0.1)
    d, _ = turn(busy, st, now=1060 + 100)
    assert d.action == "hold" and "cooldown" in d.reason
    d, _ = turn(busy, st, now=1060 + 121)
    assert (d.action, d.kind) == ("try", "raise")


def test_too_few_samples_or_too_short_a_window_holds():
    d, st = turn(replicas(1, running=8, waiting=5, kv=0.1, samples=150))
    assert d.action == "hold" and "too little traffic" in d.reason and st.experiment is None
    d, st = turn(replicas(1, running=8, waiting=5, kv=0.1, span=10))
    assert d.action == "hold" and "observing" in d.reason and st.experiment is None
    assert st.history == ()  # holds are not history


def test_an_outlier_replica_is_reported():
    reps = replicas(4, itl=0.03)
    reps[R3] = replica(R3, itl=0.09)
    d, _ = turn(reps)
    assert d.inputs["outlierReplicas"] == [R3]
    assert d.inputs["itlP99SecondsWorstReplica"] == pytest.approx(0.09)
    d, _ = turn(replicas(4, itl=0.03))
    assert "outlierReplicas" not in d.inputs


# --------------------------------------------------------------------------- no ratchet


def noisy_plant(state: TunerState, urls, now: float, itl_now: float) -> dict[str, Window]:
    """Replicas whose latency is a neighbour's noise, the same for every max_num_seqs; each
    reports what it runs (the canary its trial), over the window since the last change."""
    e = state.experiment
    since = e.started if e is not None else state.last_change
    span = 600.0 if since is None else min(600.0, now - since)
    settings = state.settings or AT8
    out = {}
    for u in urls:
        s = e.after if e is not None and e.canary == u else settings
        running = min(6.0, s.max_num_seqs)
        out[u] = replica(
            u,
            settings=s,
            running=running,
            waiting=0.0,
            tokens=16 * running,
            itl=itl_now,
            ttft=0.5,
            samples=int(20 * span),
            span=span,
        )
    return out


@pytest.mark.parametrize("n, seed", [(1, 0), (2, 0), (2, 1), (4, 2)])
def test_a_noisy_neighbour_never_walks_max_num_seqs_down(n, seed):
    rng = random.Random(seed)
    urls = [f"http://r{i}" for i in range(n)]
    state, now = TunerState(), 1000.0
    trials, reverts = [], 0
    for _ in range(6 * 3600 // 15):
        # Over the 0.1 s target. One replica: the same level before and after a change;
        # several: noise that varies over time, the same on every replica at once.
        itl_now = 0.2 if n == 1 else rng.uniform(0.15, 0.4)
        d, state = decide_tuning(
            view(noisy_plant(state, urls, now, itl_now)), SPEC, state, AT8, now
        )
        if d.action in ("try", "canary"):
            trials.append(now)
            assert d.kind == "lower"
        reverts += d.action == "revert"
        assert d.action not in ("keep", "rollout")
        if state.experiment is None:
            assert state.settings.max_num_seqs >= 8
        now += 15
    assert state.settings == AT8
    # One trial, reverted; the load never changed, so the verdict stands: no re-probes.
    assert len(trials) == 1 and reverts == 1


def test_a_rejected_lower_is_probed_again_when_the_load_changes_after_a_growing_wait():
    urls = [R0, R1]
    state, now, trials = TunerState(), 1000.0, []
    for i in range(8 * 3600 // 15):
        plant = noisy_plant(state, urls, now, 0.2)
        if i % 2:  # the load swings between turns: never the load a verdict was judged at
            plant = {u: replace(w, waiting=10.0, waiting_now=10.0) for u, w in plant.items()}
        d, state = decide_tuning(view(plant), SPEC, state, AT8, now)
        if d.action in ("try", "canary"):
            trials.append(now)
        assert d.action not in ("keep", "rollout")
        now += 15
    assert state.settings == AT8 and len(trials) >= 3
    gaps = [b - a for a, b in itertools.pairwise(trials)]
    assert all(b > a for a, b in itertools.pairwise(gaps)), gaps  # each wait longer


def test_a_rejected_lower_forbids_lowering_from_there_to_any_value():
    rejected = TunerState(settings=AT8).judged(Move(AT8, "lower"), False, 900.0, 900.0, 3600.0)
    # A slightly different batch proposes 5 instead of 4 (0.75 x 7, not 0.75 x 6): still
    # a lower from 8, still refused.
    slow = replicas(1, running=7, itl=0.2, ttft=0.5)
    d, st = turn(slow, rejected)
    assert d.action == "hold" and "rejected 1 time(s)" in d.reason, d.reason
    assert st.experiment is None
    # From other settings the same kind of move is free.
    d, _ = turn(replicas(1, settings=EngineSettings(16), running=7, itl=0.2, ttft=0.5),
                TunerState(settings=EngineSettings(16)).judged(
                    Move(AT8, "lower"), False, 900.0, 900.0, 3600.0),
                in_force=EngineSettings(16))  # fmt: skip
    assert (d.action, d.kind) == ("try", "lower")


def test_a_trial_whose_traffic_stops_is_abandoned_without_waiting_out_its_limit():
    _, st = turn(replicas(1, running=8, waiting=5, kv=0.1))
    assert st.experiment is not None
    idle = {R0: replica(R0, settings=st.experiment.after, running=0, tokens=0, samples=0, span=61)}
    d, st = turn(idle, st, now=1061)
    assert (d.action, st.experiment) == ("abandon", None) and "no traffic" in d.reason
    assert st.verdicts == ()  # nothing was learnt
