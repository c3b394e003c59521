"""benchmarks/loopsim/evaluate.py on a miniature case: every number the report states is
read from runs on the same arrivals, and the outputs render."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.loopsim import evaluate, report
from benchmarks.loopsim.scenarios import CASES, SCENARIOS, Setting

TINY = dataclasses.replace(
    CASES["cpu"], max_num_seqs=(4, 8, 16), budgets=(512,), start=Setting(4, 512), duration=600.0
)


def test_one_seed_compares_the_loop_with_the_fixed_sweep_on_the_same_arrivals():
    steady = SCENARIOS[0]
    out = evaluate.one_seed(TINY, steady, seed=1, quiet=600.0)
    assert set(out["fixed"]) == {s.label for s in TINY.grid()}
    best = out["fixed"][out["best_fixed"]]
    assert best == max(out["fixed"].values()) > out["fixed"]["mns=4,budget=512"]
    assert out["loop_over_best"] == pytest.approx(out["loop_goodput"] / best, abs=1e-3)
    # The fixed start is rerun by nothing but the sweep: same seed, same goodput.
    again = evaluate.simulate(TINY, steady, TINY.start, 1).goodput()
    assert round(again, 2) == out["fixed"][TINY.start.label]
    assert out["decisions_after_convergence"] is not None  # steady has its quiet tail
    assert {"scale_downs_with_faults", "scale_downs_without"} <= set(out["faults"])


def test_ratios_and_the_summary_keep_undefined_seeds_apart():
    assert evaluate.ratio(3.0, 2.0) == 1.5
    assert evaluate.ratio(0.0, 0.0) == 1.0
    assert evaluate.ratio(1.0, 0.0) is None
    seeds = [
        {"loop_over_best": r, "loop_over_start": None, "decisions_per_hour": 2.0,
         "reversals": 1, "kept": 0, "decisions_after_convergence": 0,
         "faults": {"scale_downs_with_faults": 0, "scale_downs_without": 1,
                    "scale_downs_on_failed_scrapes": 0}}
        for r in (0.5, 1.0, 0.9)
    ]  # fmt: skip
    s = evaluate.summarize(seeds, long=True)
    assert s["loop_over_best"] == {"median": 0.9, "worst": 0.5, "undefined": 0}
    assert s["loop_over_start"] == {"median": None, "worst": None, "undefined": 3}
    assert (s["reversals"], s["clean_scale_downs"]) == (3, 3)


def test_the_report_renders_table_json_and_plot(tmp_path):
    summary = {
        "loop_over_best": {"median": 0.97, "worst": 0.9, "undefined": 0},
        "loop_over_start": {"median": 1.5, "worst": None, "undefined": 1},
        "decisions_per_hour": 3.0, "reversals": 2, "kept": 1, "fault_scale_downs": 0,
        "clean_scale_downs": 1, "scale_downs_on_failed_scrapes": 0,
    }  # fmt: skip
    results = {"cases": {"cpu": {"steady": {"summary": summary}}}, "seeds": 1}
    table = report.table(results)
    assert "| cpu | steady | 0.97 (0.90) | 1.50 (n/a) | 3.0 | 1 | 2 | - | 0 / 1 (0) |" in table
    report.write_json(results, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == results
    report.plot(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
