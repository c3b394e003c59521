"""benchmarks/realtune's pure parts: the ABBA schedule, the pairing and its bootstrap, the
pass criteria, the summary of windows, the load's arrival times, CPU sets, the hog's
schedule and the KV-constrained cache's size."""

from __future__ import annotations

import pytest

from benchmarks.realtune import abba, report
from benchmarks.realtune.load import poisson_arrivals
from benchmarks.realtune.machine import bench_cpus, parse_cpu_sets, split_cpus
from benchmarks.realtune.window import Plan, hog_on
from benchmarks.tune import kv_constrained_memory


def test_two_arms_run_in_abba_blocks_each_arm_on_each_server_equally():
    order = abba.schedule(["T", "F"], 8, seed=3)
    for block in (order[:4], order[4:]):
        assert block[0] == block[3] and block[1] == block[2] and block[0] != block[1]
        assert sorted(b[0] for b in block) == ["F", "F", "T", "T"]  # server 0
    assert abba.schedule(["T", "F"], 8, seed=3) == order  # seeded, reproducible
    starts = {tuple(abba.schedule(["T", "F"], 4, seed=s)[0]) for s in range(20)}
    assert starts == {("T", "F"), ("F", "T")}  # the block's first half is drawn


def test_three_arms_rotate_and_mirror():
    order = abba.schedule(["T", "F", "S"], 6, seed=1)
    assert order[:3] == order[3:][::-1]
    assert all(sorted(r) == ["F", "S", "T"] for r in order)
    assert sorted(r[0] for r in order) == ["F", "F", "S", "S", "T", "T"]
    assert len(abba.schedule(["T", "F"], 5, seed=0)) == 5


def test_ratio_handles_a_fixed_arm_that_served_nothing():
    assert abba.ratio(3.0, 4.0) == 0.75
    assert abba.ratio(0.0, 0.0) == 1.0
    assert abba.ratio(1.0, 0.0) is None  # unbounded


def test_bootstrap_median_and_intervals():
    b = abba.bootstrap_median([1.0] * 5, seed=0)
    assert b == {"median": 1.0, "p2.5": 1.0, "p10": 1.0, "p90": 1.0, "p97.5": 1.0}
    b = abba.bootstrap_median([0.5, 0.9, 1.0, 1.1, 1.5], seed=0)
    assert b["median"] == 1.0
    assert 0.5 <= b["p2.5"] <= b["p10"] <= b["median"] <= b["p90"] <= b["p97.5"] <= 1.5
    assert b["p2.5"] < 1.0 < b["p97.5"]
    unbounded = abba.bootstrap_median([None, None, None], seed=0)
    assert unbounded["median"] is None and unbounded["p2.5"] is None  # inf written as null


def test_changes_per_hour_counts_each_hour():
    c = abba.changes_per_hour([10.0, 100.0, 3700.0], 7200.0)
    assert c == {"changes": 3, "per_hour": 1.5, "by_hour": [2, 1], "seconds": 7200.0}
    assert abba.changes_per_hour([], 60.0)["by_hour"] == [0]


def _d(before: int, after: int, hog: bool, budget=(None, None)) -> dict:
    return {
        "hog": hog,
        "before": {"max_num_seqs": before, "max_num_batched_tokens": budget[0]},
        "after": {"max_num_seqs": after, "max_num_batched_tokens": budget[1]},
    }


def test_capacity_reducing_changes_during_the_hog():
    decisions = [_d(8, 16, True), _d(16, 8, False), _d(16, 12, True),
                 _d(16, 16, True, (512, 256)), _d(16, 16, True, (256, 512))]  # fmt: skip
    assert abba.capacity_reducing_during_hog(decisions) == [decisions[2], decisions[3]]


def _rows(pairs: list[tuple[float, float]]) -> list[dict]:
    return [
        {"T": {"goodput_whole": t, "goodput_second_half": t},
         "F": {"goodput_whole": f, "goodput_second_half": f}}
        for t, f in pairs
    ]  # fmt: skip


def test_criteria_pass_and_fail_on_their_thresholds():
    good = abba.evaluate(_rows([(99, 100)] * 5), [50.0] * 5, None, None, seed=0)["criteria"]
    assert good["median_paired_ratio"]["pass"] and good["lower_bound_2_5"]["pass"]
    assert good["no_repeat_below_start"] == {"value": 1.98, "threshold": 1.0, "pass": True}
    assert good["soak_changes_per_hour"]["pass"] is None  # not run is not a pass
    assert good["hog_capacity_reducing_changes"]["pass"] is None
    pairs = [(96, 100), (97, 100), (96, 100), (50, 100), (97, 100)]
    bad = abba.evaluate(_rows(pairs), [60.0] * 5, {"by_hour": [3, 1], "seconds": 7200.0},
                        {"capacity_reducing": 1}, seed=0)["criteria"]  # fmt: skip
    assert bad["median_paired_ratio"]["pass"]  # 0.96
    assert bad["no_repeat_below_start"]["pass"] is False  # 50 < 60
    assert bad["soak_changes_per_hour"]["value"] == 3 and not bad["soak_changes_per_hour"]["pass"]
    assert bad["hog_capacity_reducing_changes"]["pass"] is False
    low = abba.evaluate(_rows([(96, 100), (40, 100), (96, 100)]), [1.0] * 3, None, None, 0)
    assert low["criteria"]["lower_bound_2_5"]["pass"] is False
    void = abba.evaluate(_rows([(0, 0), (5, 10)]), [0.0] * 2, None, None, seed=0)["criteria"]
    assert void["median_paired_ratio"]["pass"] is None  # 0 / 0 is no evidence of a pass
    assert "repeat(s) [0]" in void["lower_bound_2_5"]["note"]
    assert void["no_repeat_below_start"]["pass"] is None  # the start served nothing either
    short = abba.evaluate(_rows([(1, 1)]), [1.0], abba.changes_per_hour([], 60.0), None, 0)
    assert short["criteria"]["soak_changes_per_hour"]["pass"] is None  # not a 2 h soak


def _window(arms: dict[str, dict], seconds: float = 3600.0) -> dict:
    return {"t_score": 0.0, "t_end": seconds, "load_average": [[1.0], [1.0]],
            "arms": [{"arm": k, "server": i, **v} for i, (k, v) in enumerate(arms.items())]}  # fmt: skip


def _arm(goodput: float, decisions=()) -> dict:
    return {"goodput_whole": goodput, "goodput_second_half": goodput,
            "decisions": list(decisions), "final": {"max_num_seqs": 8}}  # fmt: skip


def test_calibration_picks_the_best_median_and_the_smaller_on_a_tie():
    table = report.calibration(
        [_window({"8": _arm(10), "48": _arm(30)}), _window({"48": _arm(20), "8": _arm(30)}),
         _window({"16": _arm(25), "32": _arm(25)})]
    )  # fmt: skip
    assert list(table) == ["8", "16", "32", "48"]
    assert table["8"]["median"] == 20 and table["48"]["median"] == 25
    assert report.best_fixed(table) == 16


def test_summary_takes_the_start_from_the_same_window_or_the_calibration():
    raise_at = {"time": 30.0, **_d(8, 16, False)}
    repeats = [_window({"T": _arm(90, [raise_at]), "F": _arm(100), "S": _arm(40)}),
               _window({"F": _arm(100), "T": _arm(95), "S": _arm(50)})]  # fmt: skip
    s = report.summary(repeats, "S", None, None, None, seed=0)
    assert s["over_start"] == [2.25, 1.9]
    assert s["whole"]["ratios"] == [0.9, 0.95]
    assert s["repeats"][1]["servers"] == {"F": 0, "T": 1, "S": 2}
    assert s["changes_per_hour_tuned"] == [1.0, 0.0]
    s = report.summary(repeats, None, 100.0, None, None, seed=0)
    assert s["criteria"]["no_repeat_below_start"]["pass"] is False
    assert "calibration" in s["start_goodput_from"]
    hog = _window({"T": _arm(1, [{"time": 5.0, **_d(16, 8, True)}]), "F": _arm(1)})
    s = report.summary(repeats, "S", None, _window({"T": _arm(1), "F": _arm(1)}, 7200), hog, 0)
    assert s["criteria"]["soak_changes_per_hour"]["pass"] is True
    assert s["criteria"]["hog_capacity_reducing_changes"]["value"] == 1


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a = poisson_arrivals(5.0, 200.0, seed=7)
    assert a == poisson_arrivals(5.0, 200.0, seed=7) != poisson_arrivals(5.0, 200.0, seed=8)
    assert a == sorted(a) and a[0] > 0 and a[-1] < 200.0
    assert len(a) == pytest.approx(1000, rel=0.15)


def test_cpu_sets_for_servers():
    assert parse_cpu_sets("0,1") == [{0}, {1}]
    assert parse_cpu_sets("0-1,2+3") == [{0, 1}, {2, 3}]
    assert split_cpus(2, {0, 1}) == [{0}, {1}]
    assert split_cpus(2, {0, 1, 2, 3, 4}) == [{0, 1}, {2, 3}]
    assert split_cpus(3, {0, 1}) == [{0}, {1}, {0}]
    assert bench_cpus([{0, 1}, {2, 3}], {0, 1, 2, 3, 4}) == {4}
    assert bench_cpus([{0}, {1}], {0, 1}) == {0, 1}  # shared: no spare CPU


def test_the_hog_is_off_for_a_baseline_then_alternates():
    plan = Plan(0, 100, lambda url, t0: None, lambda s: None, 1, 1, hog_period=20)
    assert [hog_on(plan, t) for t in (0, 19.9, 20, 39.9, 40, 65)] == [
        False, False, True, True, False, True,
    ]  # fmt: skip
    assert not hog_on(Plan(0, 100, lambda url, t0: None, lambda s: None, 1, 1), 30)


def test_a_kv_constrained_cache_holds_the_asked_sequences():
    assert kv_constrained_memory(16, 128) == "45MiB"  # 16 x 128 tokens x 23,040 B
    assert kv_constrained_memory(1, 1) == "1MiB"
