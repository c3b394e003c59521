"""The planner: the engine settings a replica should run, from its fitted step model
(plant.py) and the workload (demand.py). Pure: no I/O, no clock.

- The latency cap ``n_lat``: the largest max_num_seqs whose *upper* bound on the mean step
  keeps a request's mean time per output token within ``headroom`` x the SLO, with the
  batch full and carrying the prefill its own arrivals bring (n x prompt / output tokens a
  step). Never past twice the largest batch observed: the model does not extrapolate.
- The KV cap ``n_kv``: the KV blocks over the blocks a sequence holds on average in a full
  batch (its prompt and half its output, plus a partly filled block). No safety margin:
  the scheduler admits a request only when its prompt's blocks are free, so slots past
  what the cache holds stay empty, and the tail's preemptions are the thrash guardrail's
  (at 0.85 x the blocks, the simulator's KV-bound CPU cells held 16 slots where 18 and
  up served 7 % more).
- The plan: ``min(n_lat, n_kv, tuning.maxNumSeqs.max)``. A max_num_seqs above the demand
  costs nothing (the cap does not bind), so raising to the plan is safe whenever the
  upper bound allows it. A lower is planned only when the model is sure (its *lower*
  bound on the step at today's setting misses the SLO, and the plan's mean TPOT is at
  least MIN_RELIEF under today's: the batch is to blame) or the KV cache cannot hold it.
- Capacity: the requests per second one replica completes at the plan within the SLO,
  which the autoscaler divides the arrival rate by (one capacity model for both loops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchpilot.operator.loop.demand import Demand
from batchpilot.operator.loop.plant import Fit

HEADROOM = 0.9  # plan to this share of the TPOT target
RAISE_HYSTERESIS = 1.25  # a planned raise moves by at least this factor
LOWER_HYSTERESIS = 0.8  # a planned lower moves by at least this factor
MIN_RELIEF = 0.1  # a lower for latency must cut the model's mean TPOT by this share
GRAPH_FLOOR_GAIN = 1.05  # a cap falls to the graph size under it for this x its capacity
GRAPH_FLOOR_REACH = 1.25  # ... and only from within this x that size


@dataclass(frozen=True)
class Bounds:
    min: int
    max: int


@dataclass(frozen=True)
class Plan:
    max_num_seqs: int  # what the replica should run
    latency_cap: int
    kv_cap: int | None
    tpot_at_plan: float  # predicted mean TPOT at the plan, batch full (upper bound)
    capacity: float  # requests/s one replica completes at the plan within the SLO
    why: str
    reach: int = 0  # the largest batch the model predicts (twice the largest observed)

    def to_status(self) -> dict:
        out = {
            "maxNumSeqs": self.max_num_seqs,
            "latencyCap": self.latency_cap,
            "predictedTpotSeconds": round(self.tpot_at_plan, 5),
            "capacityRequestsPerSecond": round(self.capacity, 4),
            "why": self.why,
        }
        if self.kv_cap is not None:
            out["kvCap"] = self.kv_cap
        return out


def full_batch(n: float, demand: Demand, step: float | None = None) -> tuple[float, float, float]:
    """(decodes, context tokens, prefill tokens) of one step with ``n`` sequences decoding:
    contexts halfway through their output, and the prefill the arrivals bring in a step of
    ``step`` seconds, no more than a full batch's completions admit (n x prompt / output
    tokens a step; all of it when ``step`` is unknown)."""
    output = max(demand.output_mean, 1.0)
    context = n * (demand.prompt_mean + output / 2)
    admitted = n / output if step is None else min(demand.rate * step, n / output)
    return n, context, demand.prompt_mean * admitted


def _steady(bound, n: float, demand: Demand) -> float | None:
    """The step time ``bound`` predicts at batch ``n`` with the prefill that step brings: a
    fixed point, reached from above (the prefill only shrinks with the step)."""
    t = bound(*full_batch(n, demand))
    for _ in range(4):
        if t is None:
            return None
        t = bound(*full_batch(n, demand, t))
    return t


def tpot_upper(fit: Fit, n: float, demand: Demand) -> float | None:
    return _steady(fit.upper, n, demand)


def tpot_lower(fit: Fit, n: float, demand: Demand) -> float:
    return _steady(fit.lower, n, demand) or 0.0


def tpot_mean(fit: Fit, n: float, demand: Demand) -> float:
    return _steady(fit.mean, n, demand) or 0.0


def relief(fit: Fit, demand: Demand, today: float, to: float) -> float:
    """The share by which the model's mean TPOT falls from the batch ``today`` to ``to``
    (none when ``to`` is no smaller). A flat fit (every batch as slow: a busy machine, a
    target no batch meets) gives none."""
    now = tpot_mean(fit, today, demand)
    return 1 - tpot_mean(fit, min(today, to), demand) / now if now > 0 else 0.0


def batch_blamed(fit: Fit, demand: Demand, today: float, to: float) -> bool:
    """Whether the model blames the batch for today's TPOT: fewer slots would cut it by at
    least MIN_RELIEF, or they would only cost throughput."""
    return relief(fit, demand, today, to) >= MIN_RELIEF


def latency_cap(fit: Fit, demand: Demand, target: float, bounds: Bounds, budget: int | None) -> int:
    """The largest max_num_seqs whose upper-bound TPOT is within headroom x target."""
    hi = min(bounds.max, math.floor(fit.max_batch), budget or bounds.max)
    best = bounds.min
    for n in range(bounds.min, hi + 1):
        t = tpot_upper(fit, n, demand)
        if t is None or t > HEADROOM * target:
            break
        best = n
    return best


def kv_cap(demand: Demand, num_blocks: int | None, block_size: int | None) -> int | None:
    if not num_blocks or not block_size:
        return None
    # A full batch holds sequences at every stage of their output: on average the prompt
    # and half the output, plus the block each has partly filled. The tail is the thrash
    # guardrail's (tested) business, not a reason to size every slot for the longest.
    tokens = max(1.0, demand.prompt_mean + demand.output_mean / 2)
    return max(1, math.floor(num_blocks / (tokens / block_size + 1)))


def graph_floor(fit: Fit, demand: Demand, n: int) -> int:
    """``n``, or the CUDA-graph size under it where a full batch of that completes
    GRAPH_FLOOR_GAIN x as many requests a second: a batch past a size runs padded to the
    next (a KV cap of 65 where 64 and 128 are captured runs as 128 does, for 65 sequences).
    Only just past a size (within GRAPH_FLOOR_REACH x it), where few slots are given up
    for a whole padded batch: further, a young model's error decides (45 s into the
    simulator's KV-bound GPU workload one put 32 slots ahead of 63, padded to 64, and
    63 -> 32 cost 6 % of the best fixed setting)."""
    sizes = fit.model.padding.sizes
    below = [size for size in sizes if size < n]
    if not below or n in sizes or n > sizes[-1] or n > GRAPH_FLOOR_REACH * below[-1]:
        return n
    gain = capacity_in(fit, demand, below[-1]) / max(capacity_in(fit, demand, n), 1e-12)
    return below[-1] if gain >= GRAPH_FLOOR_GAIN else n


def plan(
    fit: Fit,
    demand: Demand,
    target: float,
    bounds: Bounds,
    current: int,
    budget: int | None,
    kv: tuple[int | None, int | None],
) -> Plan:
    """The setting the model supports, and why."""
    uncapped = latency_cap(fit, demand, target, bounds, budget)
    lat = graph_floor(fit, demand, uncapped)
    kvc = kv_cap(demand, *kv)
    if kvc is not None:
        kvc = graph_floor(fit, demand, kvc)
    n = max(bounds.min, min(lat, kvc if kvc is not None else lat, bounds.max))
    t = tpot_upper(fit, n, demand) or tpot_mean(fit, n, demand)
    capacity = n / (max(demand.output_mean, 1.0) * t) if t > 0 else 0.0
    binding = "the KV cache" if kvc is not None and kvc < lat else "the TPOT target"
    reach = math.floor(fit.max_batch)
    below_bounds = reach < bounds.max and (budget is None or reach < budget)
    if binding == "the TPOT target" and lat == uncapped == reach and below_bounds:
        # Not the target: the model stops at twice the largest batch it has seen (a kind
        # run's status said "the TPOT target binds" at a 30 s target, 75 ms steps).
        binding = "the model's reach (twice the largest batch seen)"
    if n == bounds.max and lat >= bounds.max and (kvc is None or kvc >= bounds.max):
        binding = "tuning.maxNumSeqs.max"
    why = (
        f"model: step {tpot_mean(fit, n, demand) * 1000:.1f} ms at batch {n} "
        f"(upper {t * 1000:.1f} ms against the {target * 1000:.0f} ms TPOT target), "
        f"latency cap {lat}, KV cap {kvc if kvc is not None else 'unknown'}: {binding} binds"
    )
    return Plan(n, lat, kvc, t, capacity, why, reach)


def planned_move(p: Plan, fit: Fit, demand: Demand, target: float, current: int) -> int | None:
    """The max_num_seqs to move to, or None: a raise past the hysteresis whenever the
    upper bound allows it; a lower only when the lower bound at today's setting misses the
    target or the KV cache cannot hold today's setting, and never to a plan that completes
    fewer requests a second than arrive (it would build a queue every request pays for).
    A plan held to the model's reach is no such plan: the KV cache's part of the lower
    then goes ahead alone."""
    if p.max_num_seqs >= RAISE_HYSTERESIS * current:
        return p.max_num_seqs
    if p.max_num_seqs > LOWER_HYSTERESIS * current:
        return None
    kv_short = p.kv_cap is not None and p.kv_cap < current
    if demand.rate <= p.capacity:
        sure = (
            fit.identified
            and current <= fit.max_batch
            and tpot_lower(fit, current, demand) > target
            and batch_blamed(fit, demand, current, p.max_num_seqs)
        )
        return p.max_num_seqs if sure or kv_short else None
    if kv_short and p.max_num_seqs == p.reach < p.kv_cap <= LOWER_HYSTERESIS * current:
        # Its capacity is the model's upper bound at twice the largest batch seen, and
        # under a closed loop's arrivals (as fast as they are served) it came out under
        # them (a kind run: 0.83 against 0.91 requests a second). The batches that ran are
        # at most half of it, so the KV cap, past it, cuts none of them.
        return p.kv_cap
    return None


def capacity_batch(fit: Fit, demand: Demand, target: float, n: int, bounds: Bounds) -> int:
    """The batch a replica's capacity at max_num_seqs ``n`` is made at: a full one at ``n``,
    or at the latency cap when ``n`` is past it (requests admitted beyond the cap miss
    their target and add nothing)."""
    return max(1, min(n, latency_cap(fit, demand, target, bounds, None)))


def capacity_at(fit: Fit, demand: Demand, target: float, n: int, bounds: Bounds) -> float:
    """Requests per second one replica completes within the TPOT target at max_num_seqs
    ``n``, at its capacity_batch."""
    return capacity_in(fit, demand, capacity_batch(fit, demand, target, n, bounds))


def capacity_in(fit: Fit, demand: Demand, batch: int) -> float:
    """Requests per second one replica completes running a full ``batch``."""
    t = tpot_mean(fit, batch, demand)
    return batch / (max(demand.output_mean, 1.0) * t) if t > 0 else 0.0


UTILISATION = 0.8  # replicas are sized to run at this share of their capacity


def replicas_for(arrivals_per_second: float, capacity: float) -> int | None:
    """The replicas the arrival rate needs at ``capacity`` per replica, None without one."""
    if capacity <= 0:
        return None
    return max(1, math.ceil(arrivals_per_second / (UTILISATION * capacity)))
