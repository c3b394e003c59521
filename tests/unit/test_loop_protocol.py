"""benchmarks/loopsim's protocol (the loop review's §5.1): plants and workloads from JSON,
the plants' step time, the scores, and a two-seed smoke run of the runner. The loop is
not asserted to pass here: the protocol measures it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks.loopsim import protocol
from benchmarks.loopsim import protocol_score as score
from benchmarks.loopsim.calibration import CPU, H100_LLAMA3_8B
from benchmarks.loopsim.noise import EpisodicNoise, step_factor
from benchmarks.loopsim.plant_spec import SpecError, load_plant
from benchmarks.loopsim.replica import ReplicaConfig, ReplicaSim, StepNoise
from benchmarks.loopsim.workload_spec import build, load_workload, workload_from_dict
from benchmarks.loopsim.workloads import Request

LOOPSIM = Path(__file__).resolve().parents[2] / "benchmarks" / "loopsim"
PLANTS = sorted((LOOPSIM / "plants").glob("*.json"))
WORKLOADS = sorted((LOOPSIM / "workloads").glob("*.json"))


def plant_data(name: str = "cpu") -> dict:
    return json.loads((LOOPSIM / "plants" / f"{name}.json").read_text())


# --------------------------------------------------------------------------- plants


def test_the_shipped_plants_of_today_are_todays_calibrations():
    assert load_plant(LOOPSIM / "plants" / "cpu.json").calibration.model == CPU.model
    h100 = load_plant(LOOPSIM / "plants" / "h100.json")
    assert h100.calibration.model == H100_LLAMA3_8B.model
    assert h100.calibration.kv_cache_bytes == H100_LLAMA3_8B.kv_cache_bytes
    assert h100.label == "derived"
    m = CPU.model  # the step time is today's formula, to the last bit
    assert m.step_seconds(7, 1234, 99) == (
        m.step_base_s + m.step_per_seq_s * 7 + m.step_per_context_token_s * 1234
        + m.prefill_per_token_s * 99
    )  # fmt: skip


def test_the_gpu_mismatch_plant_pads_a_decode_batch_to_its_graph_size():
    m = load_plant(LOOPSIM / "plants" / "h100-mismatch.json").model
    assert m.step_seconds(33, 0, 0) == m.step_seconds(64, 0, 0)  # 33 runs as 64
    assert m.step_seconds(33, 0, 0) - m.step_seconds(32, 0, 0) > 32 * m.step_per_seq_s
    assert m.step_seconds(300, 0, 0) > m.step_seconds(256, 0, 0)  # above 256: unpadded
    assert m.step_seconds(0, 0, 100) == m.step_base_s + m.prefill_per_token_s * 100


def test_the_cpu_mismatch_plant_is_superlinear_and_25_percent_off():
    m = load_plant(LOOPSIM / "plants" / "cpu-mismatch.json").model
    assert m.step_base_s == pytest.approx(0.75 * CPU.model.step_base_s)
    assert m.step_per_seq_s == pytest.approx(1.25 * CPU.model.step_per_seq_s)
    linear = m.step_seconds(64, 64 * 211, 0) - m.step_per_seq_sq_s * 64 * 64
    extra = m.step_per_seq_sq_s * 64 * 64
    assert 0.25 < extra / linear < 0.35  # about +30% at batch 64
    assert m.step_seconds(64, 0, 0) > 2 * m.step_seconds(32, 0, 0)  # more than linear


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d.pop("step_per_seq_s"), "'step_per_seq_s' is missing"),
        (lambda d: d.update(block_size="16"), "'block_size' must be int"),
        (lambda d: d.update(step_base_s=-1.0), "'step_base_s' must be positive"),
        (lambda d: d["slo"].pop("itl_s"), "slo: field 'itl_s' is missing"),
        (lambda d: d.update(graph_sizes=[1, "2"]), "'graph_sizes' must be a list"),
        (lambda d: d.update(label="guessed"), "'label' must be one of"),
    ],
)
def test_a_bad_plant_file_names_the_field(tmp_path, change, named):
    data = plant_data()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=named) as e:
        load_plant(path)
    assert str(path) in str(e.value)


def test_a_bad_workload_names_the_field():
    with pytest.raises(SpecError, match="'kind' must be one of"):
        workload_from_dict({"name": "x", "kind": "sine", "rate_of_capacity": 1.0})
    with pytest.raises(SpecError, match="'rate_of_capacity' is missing"):
        workload_from_dict({"name": "x", "kind": "steady"})
    with pytest.raises(SpecError, match="params: field 'at' is missing"):
        workload_from_dict({"name": "x", "kind": "step", "rate_of_capacity": 1.0,
                            "params": {"before": 0.5, "after": 1.3}})  # fmt: skip
    with pytest.raises(SpecError, match="'quiet_windows'"):
        workload_from_dict({"name": "x", "kind": "steady", "rate_of_capacity": 1.0,
                            "quiet_windows": [[0.5, 2.0]]})  # fmt: skip
    with pytest.raises(SpecError, match="'client_patience_of_ttft' must be positive"):
        workload_from_dict({"name": "x", "kind": "steady", "rate_of_capacity": 1.0,
                            "client_patience_of_ttft": 0})  # fmt: skip


# --------------------------------------------------------------------------- workloads


def test_every_shipped_workload_builds_on_every_plant():
    assert len(PLANTS) == 4 and len(WORKLOADS) == 13
    ids = sorted(load_workload(w).id for w in WORKLOADS)
    assert ids == sorted(f"W{i}" for i in range(1, 14))
    for p in map(load_plant, PLANTS):
        for w in map(load_workload, WORKLOADS):
            built = build(w, p)
            assert built.rate > 0 and built.duration > 0
            arrivals = built.workload.requests(min(built.duration, 120.0), seed=1)
            assert next(arrivals, None) is not None, (p.name, w.name)


def _overloaded_replica(patience: float | None) -> ReplicaSim:
    """One slot, 40 requests at once: the queue outlasts any patience of a few steps."""
    config = ReplicaConfig(max_num_seqs=1, client_patience_s=patience)
    r = ReplicaSim("sim://r", config, CPU.model, start=0.0)
    for i in range(40):
        r.submit(Request(0.001 * i, 64, 16))
    r.advance_to(30.0)
    return r


def test_clients_that_give_up_leave_the_queue_before_their_first_token():
    step = CPU.model.step_seconds(1, 80, 0)
    patient, impatient = _overloaded_replica(None), _overloaded_replica(1.0)
    assert patient.abandoned == 0 and max(r.ttft for r in patient.done) > 5.0
    assert impatient.abandoned > 30 and impatient.finished + impatient.abandoned == 40
    # Whoever is served started within the patience (the last check is a step before).
    assert max(r.first_token - r.arrival for r in impatient.done) < 1.0 + 3 * step
    # W8's clients give up at half the plant's TTFT target.
    w8 = load_workload(LOOPSIM / "workloads" / "w08-overload.json")
    cpu = load_plant(LOOPSIM / "plants" / "cpu.json")
    assert w8.client_patience(cpu) == 0.5 * cpu.ttft_target
    assert load_workload(LOOPSIM / "workloads" / "w01-steady.json").client_patience(cpu) is None


def test_todays_rates_are_about_0_96_of_the_start_settings_capacity():
    steady = load_workload(LOOPSIM / "workloads" / "w01-steady.json")
    heavy = load_workload(LOOPSIM / "workloads" / "w05-heavy-prefill.json")
    cpu, h100 = (load_plant(LOOPSIM / "plants" / f"{n}.json") for n in ("cpu", "h100"))
    assert build(steady, cpu).rate == pytest.approx(0.9, rel=0.05)  # scenarios.py's
    assert build(steady, h100).rate == pytest.approx(30.0, rel=0.05)
    assert build(heavy, cpu).rate == pytest.approx(1.0, rel=0.05)
    assert build(heavy, h100).rate == pytest.approx(12.0, rel=0.05)


def test_the_episodic_neighbour_is_on_ten_minutes_in_thirty():
    noise = EpisodicNoise(1800, 600, 4.0, offset_seconds=300)
    assert noise.episodes(3600) == [(300, 900), (2100, 2700)]
    assert [noise.factor_at(t) for t in (0, 299, 300, 899, 900, 2100)] == [1, 1, 4, 4, 1, 4]
    # An i.i.d. neighbour draws once a step, as replica.py always did.
    iid, a, b = StepNoise(0.5, 3.0), random.Random(3), random.Random(3)
    assert [step_factor(iid, 0.0, a) for _ in range(20)] == [
        3.0 if b.random() < 0.5 else 1.0 for _ in range(20)
    ]


# --------------------------------------------------------------------------- scores


def test_quiet_changes_count_the_busiest_hour_inside_the_windows():
    times = [100.0, 2000.0, 2100.0, 2200.0, 5000.0, 9000.0]
    assert score.quiet_changes(times, [(0.0, 1.0)], 10_000, "hour") == 4  # 2000-5000
    assert score.quiet_changes(times, [(0.0, 0.15)], 10_000, "hour") == 1
    assert score.quiet_changes(times, [(0.0, 1.0)], 10_000, "run") == 6


def test_recovery_is_the_first_whole_window_after_the_step_within_5_percent():
    best = [10.0] * 80
    loop = [10.0] * 20 + [0.0] * 20 + [10.0] * 40  # the step at 300 s, 15 s intervals
    # Whole windows from 600 s on; one 5% short of it (a zero in 20 points) counts too.
    assert score.recovery_seconds(loop, best, 300.0, 15.0) == 285.0
    assert score.recovery_seconds([0.0] * 80, best, 300.0, 15.0) is None


def test_the_held_out_best_ignores_the_seed_itself():
    fixed = {0: {"a": 10.0, "b": 1.0}, 1: {"a": 1.0, "b": 5.0}, 2: {"a": 1.0, "b": 5.0}}
    assert score.held_out_best(fixed, 0) == "b"
    assert score.held_out_best(fixed, 1) == "a"  # seeds 0 and 2: medians 5.5 and 3
    assert score.bootstrap_lower([1.0] * 5) == 1.0


# --------------------------------------------------------------------------- the runner


def test_a_two_seed_smoke_run_writes_every_row_and_criterion(tmp_path, capsys):
    out = tmp_path / "loop.json"
    workloads = [
        LOOPSIM / "workloads" / f for f in ("w01-steady.json", "w07-episodic-neighbour.json")
    ]
    argv = ["--plants", str(LOOPSIM / "plants" / "cpu.json"), "--workloads", *map(str, workloads),
            "--seeds", "2", "--duration-scale", "0.1", "--jobs", "2", "--out", str(out)]  # fmt: skip
    assert protocol.main(argv) == 0
    results = json.loads(out.read_text())
    assert len(results["rows"]) == 1 * 2 * 3 * 2  # plants x workloads x starts x seeds
    assert len(results["cells"]) == 1 * 2 * 3
    assert {"commit", "date", "cpu_flags", "args", "rows", "cells"} <= results.keys()
    for cell in results["cells"]:
        assert set(cell["criteria"]) == {
            "median_over_best", "lower_bound_over_best", "second_half_median",
            "worst_over_start", "quiet_changes", "static_max", "episodes", "recovery",
        }  # fmt: skip
        assert isinstance(cell["pass"], bool)
        assert cell["seeds"] == 2
    episodic = [c for c in results["cells"] if c["workload_id"] == "W7"]
    assert all(c["criteria"]["episodes"] is not None for c in episodic)
    for row in results["rows"]:
        assert row["over_best"] is None or row["over_best"] >= 0
        assert row["knob_changes"] >= 0
    assert "steady" in capsys.readouterr().out
