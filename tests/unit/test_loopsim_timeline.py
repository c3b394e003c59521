"""benchmarks/loopsim/timeline.py on the first 25 minutes of the CPU mismatch diurnal cell:
the series cover every turn, max_num_seqs moves only at the loop's recorded decisions, and
the plot is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.loopsim import timeline

LOOPSIM = Path(timeline.__file__).parent
PLANT = LOOPSIM / "plants" / "cpu-mismatch.json"
DIURNAL = LOOPSIM / "workloads" / "w03-diurnal.json"
MINUTES = 25  # far enough into the rise for the queue guardrail to act


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("timeline")
    png, data = out / "timeline.png", out / "timeline.json"
    argv = ["--plant", str(PLANT), "--workload", str(DIURNAL), "--seed", "0",
            "--start", "under", "--fixed", "64,128", "--minutes", str(MINUTES),
            "--out", str(png), "--json", str(data)]  # fmt: skip
    assert timeline.main(argv) == 0
    return json.loads(data.read_text()), png


def test_every_series_has_one_value_a_turn(run):
    (cell,) = run[0]["cells"]
    turns = int(MINUTES * 60 / cell["interval_s"])
    for arm in ("loop", "fixed"):
        for name, values in cell[arm]["series"].items():
            assert len(values) == turns, (arm, name)
    assert len(cell["loop"]["turns"]) == turns
    assert cell["loop"]["series"]["time_s"][-1] == MINUTES * 60
    assert cell["fixed"]["turns"] is None  # tuning off: no loop turns
    assert set(cell["fixed"]["series"]["max_num_seqs"]) == {64}


def test_max_num_seqs_changes_exactly_at_the_recorded_decisions(run):
    (cell,) = run[0]["cells"]
    s = cell["loop"]["series"]
    before = [8, *s["max_num_seqs"][:-1]]  # the plant's start, then the previous turn
    moved = {t: m for t, b, m in zip(s["time_s"], before, s["max_num_seqs"], strict=True)
             if m != b}  # fmt: skip
    changes = {d["time_s"]: d["to"] for d in cell["decisions"] if d["from"] != d["to"]}
    assert moved == changes
    assert moved, "the loop changed nothing in 25 minutes"
    assert all(d["category"] != "held" for d in cell["decisions"] if d["time_s"] in changes)
    # What the tuner decided is what status puts in force, turn by turn.
    decided = [t["max_num_seqs"] for t in cell["loop"]["turns"]]
    assert [d for d in decided if d is not None] == [
        m for d, m in zip(decided, s["max_num_seqs"], strict=True) if d is not None
    ]
    assert {d["category"] for d in cell["decisions"]} <= set(timeline.COLOURS)


def test_the_plot_is_a_png(run):
    png = run[1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000


def test_a_hold_is_named_by_what_it_held_without_its_numbers():
    kind = timeline.held_kind
    assert kind("a plan is due, held: dwell: 570 s left after the last change; model: x") == (
        "a plan is due, held: dwell"
    )
    assert kind(
        "latency lower held: max_num_seqs 20 -> 64 was an overload raise past the "
        "plan's 19, and the overload persists (1.29 requests/s)"
    ) == ("latency lower held: max_num_seqs # -> # was an overload raise past the plan's #")
    assert kind("a plan is due, held: 2 planned changes in the last hour already; m") == (
        kind("a plan is due, held: 3 planned changes in the last hour already; m")
    )
    assert kind("holding, nothing changed: model: step 107.7 ms") is None
