"""A plant from JSON: one replica's step-time and KV figures, plus the case the protocol
runs on it (SLO, grid, starting setting, run length). The schema is SCHEMA.md's:

    {
      "name": "cpu-mismatch",               # required, the plant's name in the results
      "label": "mismatch",                  # optional: "measured", "derived" or "mismatch"
      "step_base_s": 0.0306,                # seconds a step costs whatever its batch
      "step_per_seq_s": 0.0031875,          # per decoding sequence (the padded batch)
      "step_per_context_token_s": 2.875e-6, # per token of the decoding sequences' context
      "prefill_per_token_s": 0.0006,        # per prompt token prefilled in the step
      "step_per_seq_sq_s": 2.0e-5,          # optional: x (padded batch) squared
      "graph_sizes": [1, 2, 4, 8],          # optional: decode batches pad up to the next
      "block_size": 16, "bytes_per_block_16bit": 368640, "swap_bytes_per_s": 8e9,
      "kv_cache_bytes": 1073741824, "swap_space_bytes": 4294967296, "default_budget": 512,
      "slo": {"ttft_s": 2.0, "itl_s": 0.15},
      "grid": {"max_num_seqs": [4, 8, 16, 32, 64], "budgets": [128, 512]},
      "start": {"max_num_seqs": 8, "budget": 512},   # the under-provisioned start
      "long_prompts": [384, 512, 768],      # what a workload's "long" prompts are here
      "duration_s": 3600,                   # a run's length unless the workload says
      "recovery_limit_s": 600               # W2: the median seed recovers within this
    }

A missing or mistyped field raises ``SpecError`` naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.loopsim.calibration import Calibration, EngineModel
from benchmarks.loopsim.scenarios import Setting

LABELS = ("measured", "derived", "mismatch")
_MODEL_FLOATS = ("step_base_s", "step_per_seq_s", "step_per_context_token_s",
                 "prefill_per_token_s", "swap_bytes_per_s")  # fmt: skip
_MODEL_INTS = ("block_size", "bytes_per_block_16bit")
_CALIBRATION_INTS = ("kv_cache_bytes", "swap_space_bytes", "default_budget")


class SpecError(ValueError):
    """A plant or workload file that does not follow SCHEMA.md."""


@dataclass(frozen=True)
class Plant:
    name: str
    label: str
    calibration: Calibration
    ttft_target: float
    itl_target: float
    start: Setting
    max_num_seqs: tuple[int, ...]  # swept, and the tuner's bounds
    budgets: tuple[int, ...]
    long_prompts: tuple[int, ...]
    duration: float
    recovery_limit: float

    @property
    def model(self) -> EngineModel:
        return self.calibration.model

    def grid(self) -> list[Setting]:
        return [Setting(m, b) for m in self.max_num_seqs for b in self.budgets]


def field(data: dict, name: str, kind: type | tuple, where: str, default=...):
    """``data[name]``, checked to be a ``kind`` (ints count as floats; bools as neither)."""
    if name not in data:
        if default is ...:
            raise SpecError(f"{where}: field '{name}' is missing")
        return default
    value = data[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds:
        kinds = (*kinds, int)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise SpecError(f"{where}: field '{name}' must be {names}, not {value!r}")
    return value


def positive(data: dict, name: str, kind: type, where: str, default=..., zero_ok=False):
    value = field(data, name, kind, where, default)
    if value < 0 or (value == 0 and not zero_ok):
        raise SpecError(f"{where}: field '{name}' must be positive, not {value!r}")
    return value


def int_list(data: dict, name: str, where: str, default=...) -> tuple[int, ...]:
    values = field(data, name, list, where, default)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise SpecError(f"{where}: field '{name}' must be a list of positive integers")
    return tuple(values)


def _model(data: dict, where: str) -> EngineModel:
    kw = {k: float(positive(data, k, float, where)) for k in _MODEL_FLOATS}
    kw |= {k: positive(data, k, int, where) for k in _MODEL_INTS}
    kw["step_per_seq_sq_s"] = float(
        positive(data, "step_per_seq_sq_s", float, where, 0.0, zero_ok=True)
    )
    kw["graph_sizes"] = tuple(sorted(int_list(data, "graph_sizes", where, [])))
    return EngineModel(**kw)


def plant_from_dict(data: dict, where: str = "plant") -> Plant:
    if not isinstance(data, dict):
        raise SpecError(f"{where}: a plant is a JSON object")
    name = field(data, "name", str, where)
    label = field(data, "label", str, where, "derived")
    if label not in LABELS:
        raise SpecError(f"{where}: field 'label' must be one of {LABELS}, not {label!r}")
    ints = {k: positive(data, k, int, where) for k in _CALIBRATION_INTS}
    calibration = Calibration(name, _model(data, where), **ints)
    slo, grid = field(data, "slo", dict, where), field(data, "grid", dict, where)
    start = field(data, "start", dict, where)
    setting = Setting(positive(start, "max_num_seqs", int, f"{where}: start"),
                      positive(start, "budget", int, f"{where}: start"))  # fmt: skip
    return Plant(
        name=name,
        label=label,
        calibration=calibration,
        ttft_target=float(positive(slo, "ttft_s", float, f"{where}: slo")),
        itl_target=float(positive(slo, "itl_s", float, f"{where}: slo")),
        start=setting,
        max_num_seqs=int_list(grid, "max_num_seqs", f"{where}: grid"),
        budgets=int_list(grid, "budgets", f"{where}: grid"),
        long_prompts=int_list(data, "long_prompts", where),
        duration=float(positive(data, "duration_s", float, where)),
        recovery_limit=float(positive(data, "recovery_limit_s", float, where, 600.0)),
    )


def read_json(path: Path | str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not JSON: {e}") from e


def load_plant(path: Path | str) -> Plant:
    return plant_from_dict(read_json(path), str(path))
