"""A workload from JSON, stated relative to the plant so one file fits every plant (the
schema is SCHEMA.md's):

    {
      "name": "step", "id": "W2",
      "kind": "step",                  # steady | step | diurnal | bursty | phases
      "rate_of_capacity": 0.96,        # x the capacity below (capacity.py, analytic)
      "capacity_basis": "start",       # "start": the plant's start setting's capacity;
                                       # "best": the best SLO-feasible capacity
      "prompt_lens": "chat",           # "chat" | "long" (the plant's) | [tokens, ...]
      "output_lens": "chat",           # "chat" | "short" | [tokens, ...]
      "params": {"before": 0.5, "after": 1.3, "at": 0.3333},
      "noise": null,                   # {"kind": "iid", "probability", "factor"} or
                                       # {"kind": "episodic", "period_s", "on_s",
                                       #  "offset_s", "factor"}
      "kv_cache_fraction_of_top": null,  # KV cache that holds this fraction of the top
                                         # max_num_seqs at the mean full length
      "duration_s": null,              # else the plant's
      "quiet_windows": [[0.5, 1.0]],   # fractions of the duration
      "quiet_max_changes": 2, "quiet_per": "hour",   # or "run"
      "starts": ["under", "best", "over"],
      "worst_vs_start_min": 1.0,       # the worst seed's loop / start must reach this
      "autoscaled": false,             # one of the --autoscaled mode's workloads
      "client_patience_of_ttft": null  # clients give up on a request not started within
                                       # this x the TTFT target; null: they wait forever
    }

params by kind: step {before, after: x the rate; at: fraction of the duration}; diurnal
{amplitude: fraction of the rate; period: fraction of the duration}; bursty {burstiness};
phases {phases: [{until: fraction, rate_of_capacity, capacity_basis?, prompt_lens?,
output_lens?}, ...]}.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from benchmarks.loopsim.capacity import Lengths, best_capacity, setting_capacity
from benchmarks.loopsim.noise import EpisodicNoise
from benchmarks.loopsim.plant_spec import Plant, SpecError, field, int_list, positive, read_json
from benchmarks.loopsim.replica import StepNoise
from benchmarks.loopsim.workloads import (
    CHAT_OUTPUTS,
    CHAT_PROMPTS,
    SHORT_OUTPUTS,
    Request,
    Workload,
    bursty,
    diurnal,
    steady,
    step_load,
)

KINDS = ("steady", "step", "diurnal", "bursty", "phases")
STARTS = ("under", "best", "over")


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    id: str
    kind: str
    rate_of_capacity: float
    capacity_basis: str
    prompt_lens: str | tuple[int, ...]
    output_lens: str | tuple[int, ...]
    params: dict
    noise: dict | None
    kv_cache_fraction_of_top: float | None
    duration: float | None
    quiet_windows: tuple[tuple[float, float], ...]
    quiet_max_changes: int
    quiet_per: str
    starts: tuple[str, ...]
    worst_vs_start_min: float
    autoscaled: bool
    client_patience_of_ttft: float | None

    def client_patience(self, plant: Plant) -> float | None:
        """Seconds a client waits for its first token before giving up, or None."""
        f = self.client_patience_of_ttft
        return None if f is None else f * plant.ttft_target


@dataclass(frozen=True)
class Built:
    """A workload made concrete for one plant."""

    workload: Workload | PhasedWorkload
    noise: StepNoise | EpisodicNoise | None
    kv_cache_bytes: int
    duration: float
    rate: float  # requests/s of the (first) phase, before the load multiplier


@dataclass(frozen=True)
class PhasedWorkload:
    """Poisson arrivals whose rate and lengths change at phase ends (the mix shift)."""

    phases: tuple[tuple[float, Workload], ...]  # (end time, what runs before it)

    def requests(self, duration: float, seed: int = 0) -> Iterator[Request]:
        rng = random.Random(seed)
        peak = max(w.peak for _, w in self.phases)
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= duration:
                return
            w = next((w for end, w in self.phases if t < end), self.phases[-1][1])
            if rng.random() * peak <= w.rate(t):
                yield Request(t, rng.choice(w.prompt_lens), rng.choice(w.output_lens))


def _lens(data: dict, name: str, where: str, default: str):
    value = field(data, name, (str, list), where, default)
    if isinstance(value, list):
        return int_list(data, name, where)
    allowed = ("chat", "long") if name == "prompt_lens" else ("chat", "short")
    if value not in allowed:
        raise SpecError(f"{where}: field '{name}' must be one of {allowed} or a list")
    return value


def _windows(data: dict, where: str) -> tuple[tuple[float, float], ...]:
    windows = field(data, "quiet_windows", list, where, [])
    ok = all(
        isinstance(w, list) and len(w) == 2 and all(isinstance(x, int | float) for x in w)
        and 0 <= w[0] <= w[1] <= 1 for w in windows
    )  # fmt: skip
    if not ok:
        raise SpecError(f"{where}: field 'quiet_windows' must be [[start, end], ...] in 0..1")
    return tuple((float(a), float(b)) for a, b in windows)


def _basis(data: dict, where: str) -> str:
    basis = field(data, "capacity_basis", str, where, "start")
    if basis not in ("start", "best"):
        raise SpecError(f"{where}: field 'capacity_basis' must be 'start' or 'best'")
    return basis


def _checked_params(kind: str, params: dict, where: str) -> dict:
    w = f"{where}: params"
    if kind == "step":
        for k in ("before", "after", "at"):
            positive(params, k, float, w)
    elif kind == "diurnal":
        positive(params, "amplitude", float, w, zero_ok=True)
        positive(params, "period", float, w)
    elif kind == "bursty":
        positive(params, "burstiness", float, w)
    elif kind == "phases":
        phases = field(params, "phases", list, w)
        if not phases or not all(isinstance(p, dict) for p in phases):
            raise SpecError(f"{w}: field 'phases' must be a non-empty list of objects")
        for i, p in enumerate(phases):
            positive(p, "until", float, f"{w}: phases[{i}]")
            positive(p, "rate_of_capacity", float, f"{w}: phases[{i}]")
            _basis(p, f"{w}: phases[{i}]")
            _lens(p, "prompt_lens", f"{w}: phases[{i}]", "chat")
            _lens(p, "output_lens", f"{w}: phases[{i}]", "chat")
    return params


def _noise(data: dict, where: str) -> dict | None:
    noise = field(data, "noise", (dict, type(None)), where, None)
    if noise is None:
        return None
    w = f"{where}: noise"
    kind = field(noise, "kind", str, w)
    positive(noise, "factor", float, w)
    if kind == "iid":
        positive(noise, "probability", float, w)
    elif kind == "episodic":
        positive(noise, "period_s", float, w)
        positive(noise, "on_s", float, w)
        positive(noise, "offset_s", float, w, 0.0, zero_ok=True)
    else:
        raise SpecError(f"{w}: field 'kind' must be 'iid' or 'episodic', not {kind!r}")
    return noise


def workload_from_dict(data: dict, where: str = "workload") -> WorkloadSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{where}: a workload is a JSON object")
    kind = field(data, "kind", str, where)
    if kind not in KINDS:
        raise SpecError(f"{where}: field 'kind' must be one of {KINDS}, not {kind!r}")
    starts = tuple(field(data, "starts", list, where, list(STARTS)))
    if not starts or not set(starts) <= set(STARTS):
        raise SpecError(f"{where}: field 'starts' must be a non-empty subset of {STARTS}")
    per = field(data, "quiet_per", str, where, "hour")
    if per not in ("hour", "run"):
        raise SpecError(f"{where}: field 'quiet_per' must be 'hour' or 'run'")
    kv = field(data, "kv_cache_fraction_of_top", (float, type(None)), where, None)
    duration = field(data, "duration_s", (float, type(None)), where, None)
    return WorkloadSpec(
        name=field(data, "name", str, where),
        id=field(data, "id", str, where, ""),
        kind=kind,
        rate_of_capacity=float(positive(data, "rate_of_capacity", float, where)),
        capacity_basis=_basis(data, where),
        prompt_lens=_lens(data, "prompt_lens", where, "chat"),
        output_lens=_lens(data, "output_lens", where, "chat"),
        params=_checked_params(kind, field(data, "params", dict, where, {}), where),
        noise=_noise(data, where),
        kv_cache_fraction_of_top=None if kv is None else float(kv),
        duration=None if duration is None else float(duration),
        quiet_windows=_windows(data, where),
        quiet_max_changes=positive(data, "quiet_max_changes", int, where, 2, zero_ok=True),
        quiet_per=per,
        starts=starts,
        worst_vs_start_min=float(positive(data, "worst_vs_start_min", float, where, 1.0)),
        autoscaled=field(data, "autoscaled", bool, where, False),
        client_patience_of_ttft=_patience(data, where),
    )


def _patience(data: dict, where: str) -> float | None:
    if data.get("client_patience_of_ttft") is None:
        return None
    return float(positive(data, "client_patience_of_ttft", float, where))


def load_workload(path) -> WorkloadSpec:
    return workload_from_dict(read_json(path), str(path))


# -- made concrete for a plant


def lengths(plant: Plant, prompt_lens, output_lens) -> tuple[tuple[int, ...], tuple[int, ...]]:
    prompts = {"chat": CHAT_PROMPTS, "long": plant.long_prompts}.get(prompt_lens, prompt_lens)
    outputs = {"chat": CHAT_OUTPUTS, "short": SHORT_OUTPUTS}.get(output_lens, output_lens)
    return tuple(prompts), tuple(outputs)


def kv_cache_bytes(spec: WorkloadSpec, plant: Plant) -> int:
    if spec.kv_cache_fraction_of_top is None:
        return plant.calibration.kv_cache_bytes
    m = plant.model
    prompts, outputs = lengths(plant, spec.prompt_lens, spec.output_lens)
    blocks = -(-int(Lengths.of(prompts, outputs).full) // m.block_size)
    seqs = max(1, round(spec.kv_cache_fraction_of_top * max(plant.max_num_seqs)))
    return seqs * blocks * m.block_bytes("auto")


def rate(plant: Plant, kv: int, fraction: float, basis: str, prompts, outputs) -> float:
    """``fraction`` x the plant's capacity for these lengths (capacity.py)."""
    ls = Lengths.of(prompts, outputs)
    if basis == "start":
        return fraction * setting_capacity(plant.model, plant.start.max_num_seqs, kv, ls)
    top = max(plant.max_num_seqs)
    return fraction * best_capacity(plant.model, top, kv, ls, plant.itl_target)


def _noise_of(spec: WorkloadSpec, scale: float):
    n = spec.noise
    if n is None:
        return None
    if n["kind"] == "iid":
        return StepNoise(probability=n["probability"], factor=n["factor"])
    return EpisodicNoise(n["period_s"] * scale, n["on_s"] * scale, n["factor"],
                         n.get("offset_s", 0.0) * scale)  # fmt: skip


def _phased(spec: WorkloadSpec, plant: Plant, kv: int, duration: float, load: float):
    phases = []
    for p in spec.params["phases"]:
        prompts, outputs = lengths(plant, p.get("prompt_lens", "chat"),
                                   p.get("output_lens", "chat"))  # fmt: skip
        r = load * rate(plant, kv, p["rate_of_capacity"], p.get("capacity_basis", "start"),
                        prompts, outputs)  # fmt: skip
        phases.append((p["until"] * duration, steady(r, prompt_lens=prompts, output_lens=outputs)))
    return PhasedWorkload(tuple(phases))


def build(spec: WorkloadSpec, plant: Plant, scale: float = 1.0, load: float = 1.0) -> Built:
    """The workload on ``plant``; ``scale`` shortens every time in it (duration, episodes),
    ``load`` multiplies every rate (more replicas)."""
    duration = (spec.duration or plant.duration) * scale
    kv = kv_cache_bytes(spec, plant)
    prompts, outputs = lengths(plant, spec.prompt_lens, spec.output_lens)
    base = rate(plant, kv, spec.rate_of_capacity, spec.capacity_basis, prompts, outputs)
    r, p, kw = load * base, spec.params, {"prompt_lens": prompts, "output_lens": outputs}
    if spec.kind == "phases":
        workload = _phased(spec, plant, kv, duration, load)
    elif spec.kind == "step":
        workload = step_load(p["before"] * r, p["after"] * r, at=p["at"] * duration, **kw)
    elif spec.kind == "diurnal":
        workload = diurnal(r, p["amplitude"] * r, period=p["period"] * duration, **kw)
    elif spec.kind == "bursty":
        workload = bursty(r, burstiness=p["burstiness"], **kw)
    else:
        workload = steady(r, **kw)
    return Built(workload, _noise_of(spec, scale), kv, duration, base)
