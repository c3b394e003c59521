"""`batchpilot bench startup`'s record: medians per stage, a before and an after kept side
by side in one file, and the table it prints."""

from __future__ import annotations

import json

from batchpilot.server.bench.startup import medians, table, write_record


def start(ready: float, first: float, **stages: float) -> dict:
    return {"ready_s": ready, "first_token_s": first,
            "stages": {k.replace("_", " "): v for k, v in stages.items()}}  # fmt: skip


STARTS = [
    start(4.0, 4.5, process_up=3.9, loading_weights=0.2),
    start(9.0, 9.9, process_up=8.8, loading_weights=0.4),
    start(5.0, 5.2, process_up=4.8, loading_weights=0.3),
]


def test_each_figure_is_the_median_of_the_starts():
    assert medians(STARTS) == {"process up": 4.8, "loading weights": 0.3, "ready_s": 5.0,
                               "first_token_s": 5.2}  # fmt: skip


def test_a_stage_one_start_lacks_counts_as_zero_there():
    got = medians([start(1.0, 1.0, a=1.0), start(1.0, 1.0, a=3.0, b=2.0), start(1.0, 1.0, a=2.0)])
    assert got["a"] == 2.0 and got["b"] == 0.0


def test_runs_are_kept_by_label_in_one_file(tmp_path):
    path = tmp_path / "results" / "startup.json"
    write_record(path, {"label": "before", "series": {}})
    write_record(path, {"label": "after", "series": {}})
    write_record(path, {"label": "after", "series": {"float32": {}}})
    runs = json.loads(path.read_text())
    assert list(runs) == ["before", "after"]
    assert runs["after"]["series"] == {"float32": {}}


def test_the_table_has_a_row_per_figure_and_a_column_per_dtype():
    record = {"series": {"float32": {"starts": STARTS, "median": medians(STARTS)},
                         "auto": {"starts": STARTS, "median": {"ready_s": 2.0}}}}  # fmt: skip
    lines = table(record).splitlines()
    assert lines[0] == "| median of 3 starts, s | float32 | auto |"
    assert "| ready_s | 5.00 | 2.00 |" in lines
    assert "| loading weights | 0.30 | 0.00 |" in lines
