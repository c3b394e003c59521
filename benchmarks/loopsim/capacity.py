"""What one replica of a plant serves, analytically, so a workload's rate can be stated as a
fraction of it and one workload file fits every plant.

With requests of mean prompt P and mean output O arriving at rate λ and n sequences
decoding on average, a step carries n decodes and, by flow balance, n·P/(O-1) prompt
tokens; every sequence gets one token a step, so

    TPOT(n) = step_seconds(n, n·C, n·P/(O-1))        λ(n) = n / ((O-1)·TPOT(n))

where C is the mean context of a decoding sequence weighted by its decode steps,
P + E[(O-1)·O/2] / E[O-1]. (The plant's own step time: graph padding and the superlinear
term included.) n is bounded by what the KV cache holds at the mean full length P + O.

- a setting's capacity: λ at n = min(max_num_seqs, the KV bound), the SLO aside (the
  throughput at which its batch is full); the step budget is not modelled;
- the best capacity: the largest λ(n) over n up to the grid's top max_num_seqs and the KV
  bound with TPOT(n) within the ITL target (λ(1) when no n meets it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.loopsim.calibration import EngineModel


@dataclass(frozen=True)
class Lengths:
    prompt: float  # mean prompt tokens
    decodes: float  # mean output tokens after the first, E[O-1]
    context: float  # mean context of a decoding sequence, decode-step weighted
    full: float  # mean prompt + output

    @classmethod
    def of(cls, prompts: tuple[int, ...], outputs: tuple[int, ...]) -> Lengths:
        p = sum(prompts) / len(prompts)
        d = sum(o - 1 for o in outputs) / len(outputs)
        grown = sum((o - 1) * o / 2 for o in outputs) / len(outputs)
        o = sum(outputs) / len(outputs)
        return cls(p, max(d, 1.0), p + grown / max(d, 1.0), p + o)


def tpot(model: EngineModel, n: float, lengths: Lengths) -> float:
    return model.step_seconds(
        math.ceil(n), n * lengths.context, n * lengths.prompt / lengths.decodes
    )


def rate_at(model: EngineModel, n: float, lengths: Lengths) -> float:
    """Requests/s that keep ``n`` sequences decoding on average."""
    return n / (lengths.decodes * tpot(model, n, lengths))


def kv_bound(model: EngineModel, kv_cache_bytes: int, lengths: Lengths) -> int:
    """Sequences the KV cache holds at their mean full length (bfloat16 blocks)."""
    blocks = kv_cache_bytes // model.block_bytes("auto")
    return max(1, int(blocks // math.ceil(lengths.full / model.block_size)))


def setting_capacity(
    model: EngineModel, max_num_seqs: int, kv_cache_bytes: int, lengths: Lengths
) -> float:
    n = min(max_num_seqs, kv_bound(model, kv_cache_bytes, lengths))
    return rate_at(model, n, lengths)


def best_capacity(
    model: EngineModel, top_max_num_seqs: int, kv_cache_bytes: int, lengths: Lengths,
    itl_target: float,
) -> float:  # fmt: skip
    top = min(top_max_num_seqs, kv_bound(model, kv_cache_bytes, lengths))
    feasible = [
        rate_at(model, n, lengths)
        for n in range(1, top + 1)
        if tpot(model, n, lengths) <= itl_target
    ]
    return max(feasible, default=rate_at(model, 1, lengths))
